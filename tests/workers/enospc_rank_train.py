"""`erpo train` whose rank ERPO_TEST_ENOSPC_RANK finds the disk full while it writes checkpoint
step-ERPO_TEST_ENOSPC_STEP: its write (torch.save, DeepSpeed's script copy, save_pretrained's safetensors) of a file
whose name contains ERPO_TEST_ENOSPC_FILE (default: DeepSpeed's ZeRO optimizer shard) leaves a partial file and raises
ENOSPC, as a full disk does (used by tests/distributed/test_multirank.py)."""
import errno
import os

import deepspeed.runtime.engine
import torch
import transformers.modeling_utils

from erpo.cli import run  # as the console script: a rank ends without the interpreter's teardown (erpo.cli.run)

real_save = torch.save
FAILING = (os.environ.get("RANK", "0") == os.environ["ERPO_TEST_ENOSPC_RANK"],
           f".tmp-step-{os.environ['ERPO_TEST_ENOSPC_STEP']}", os.environ.get("ERPO_TEST_ENOSPC_FILE", "optim_states"))


real_copy = deepspeed.runtime.engine.copyfile


def disk_full_at(path) -> bool:
    on_this_rank, checkpoint, name = FAILING
    if on_this_rank and checkpoint in str(path) and name in os.path.basename(str(path)):
        with open(path, "wb") as handle:
            handle.write(b"PK\x03\x04 partial")
        return True
    return False


def full_disk_save(obj, f, *args, **kwargs):
    if disk_full_at(f):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
    return real_save(obj, f, *args, **kwargs)


def full_disk_copy(src, dst, *args, **kwargs):   # DeepSpeed's copy of its zero_to_fp32.py into the checkpoint
    if disk_full_at(dst):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))
    return real_copy(src, dst, *args, **kwargs)


real_safetensors_save = transformers.modeling_utils.safe_save_file


def full_disk_safetensors_save(tensors, filename, *args, **kwargs):   # save_pretrained's weights (the HF export)
    if disk_full_at(filename):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(filename))
    return real_safetensors_save(tensors, filename, *args, **kwargs)


torch.save = full_disk_save
deepspeed.runtime.engine.copyfile = full_disk_copy
transformers.modeling_utils.safe_save_file = full_disk_safetensors_save
run()

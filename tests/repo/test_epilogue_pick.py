"""bench.epilogue_pick: from a gemm_epilogue_probe.json (written here as bench.gemm_epilogue_probe writes it), the
passing (d) config and launch with the lowest sum of median ratios to the library's own (d) at 512 rows is picked
only when it is faster on every shape, as the erpo-epi key bench 1 takes; failing or untimed variants, other parts
and other chunk rows never count; a missing file, a shape without its 512-row chunk or without the library's row
picks nothing."""
import json

import pytest

from bench import gemm_epilogue_probe as probe
from bench.epilogue_pick import PROBE_JSON, library_variant, pick_epilogue, probe_variant
from bench.geometry import EpilogueLaunch, parse_epilogue_key
from erpo_kernels.triton_logits_gemm import LOSS_CONFIGS, Launch

SHAPES = ("qwen2.5-7b", "qwen2.5-32b")
LIBRARY_MS = {("qwen2.5-7b", 512): 1.20, ("qwen2.5-32b", 512): 1.70, ("qwen2.5-7b", 2048): 4.6,
              ("qwen2.5-32b", 2048): 6.5}
PROGRAMS = 132
LIBRARY = (str(LOSS_CONFIGS[(2, False)]), str(Launch()))  # the probe's first config, grouped pointer loads
PERSISTENT_TMA = (str(probe.CONFIGS[1]), str(Launch(PROGRAMS, True)))  # "128x128x64 w4 s4", "persistent (132), TMA"
GROUPED_TMA = (str(probe.CONFIGS[2]), str(Launch(None, True)))


def write_probe(folder, ratios: dict, rows=(512, 2048), failing=(), shapes=SHAPES, part_ratio=1.0) -> None:
    """gemm_epilogue_probe.json with every (c) and (d) row at its chunk's library (d) median times ratios[(config,
    launch)] (a number, or one per shape; 1.0 for those not named; (c) rows part_ratio), (a) and (b) at 1.1 and
    1.3 times it; the (d) variants in `failing` FAILED (timed, as the probe times them)."""
    chunks = []
    for index, shape in enumerate(shapes):
        for count in rows:
            library_ms = LIBRARY_MS[(shape, count)]
            results = [{"part": part, "config": None, "launch": None, "passed": True, "median_ms": library_ms * scale}
                       for part, scale in (("a", 1.1), ("b", 1.3))]
            for part in ("c", "d"):
                for config in probe.CONFIGS:
                    for launch in probe.launches(PROGRAMS):
                        variant = (str(config), str(launch))
                        ratio = ratios.get(variant, 1.0) if part == "d" else part_ratio
                        ratio = ratio[index] if isinstance(ratio, tuple) else ratio
                        results.append({"part": part, "config": variant[0], "launch": variant[1],
                                        "passed": not (part == "d" and variant in failing),
                                        "median_ms": library_ms * ratio})
            chunks.append({"shape": shape, "rows": count, "results": results})
    (folder / PROBE_JSON).write_text(json.dumps({"meta": {"programs": PROGRAMS}, "chunks": chunks}))


def pick(folder, **options):
    return pick_epilogue(folder / PROBE_JSON, SHAPES, **options)


def test_the_library_s_variant_is_the_probe_s_first_config_grouped_with_pointer_loads():
    assert library_variant() == LIBRARY == (str(probe.CONFIGS[0]), "grouped")


@pytest.mark.parametrize("config, launch, epilogue", [
    ("128x256x64 w8 s3", "grouped", EpilogueLaunch((128, 256, 64, 8, 3))),
    ("128x128x64 w4 s4", "persistent (132), TMA", EpilogueLaunch((128, 128, 64, 4, 4), 132, True)),
    ("256x128x64 w8 s3", "grouped, TMA", EpilogueLaunch((256, 128, 64, 8, 3), None, True))])
def test_a_probe_row_s_strings_are_its_config_and_launch(config, launch, epilogue):
    assert probe_variant(config, launch) == epilogue
    with pytest.raises(ValueError, match="no config and launch in"):
        probe_variant(config, launch.replace("grouped", "striped").replace("persistent", "striped"))


def test_the_variant_faster_on_both_shapes_with_the_lowest_sum_is_picked(tmp_path):
    """Ratios to the library's own (d) row (here 5 times the others), not to (b) nor the (c) rows (half of it)."""
    write_probe(tmp_path, {PERSISTENT_TMA: 0.9, GROUPED_TMA: (0.85, 0.99), LIBRARY: 5.0}, part_ratio=0.5)
    chosen = pick(tmp_path)
    assert chosen.key == "erpo-epi-128x128x64-w4-s4-persistent132-tma"
    assert parse_epilogue_key(chosen.key) == probe_variant(*PERSISTENT_TMA)  # bench 1 parses what it names
    assert chosen.why.startswith(f"{chosen.key}: (d) 128x128x64 w4 s4, persistent (132), TMA ({chosen.key}) at 512 "
                                 "rows, median over the library's (d) (128x256x64 w8 s3, grouped) qwen2.5-7b 0.180, "
                                 "qwen2.5-32b 0.180, sum 0.360, the lowest of 11 other passing (d) variants")
    assert chosen.why.endswith("faster than the library's on every shape")


def test_only_the_chunk_rows_asked_for_count(tmp_path):
    """A variant faster at 2048 rows alone is not picked at 512, and is at 2048 when asked (gpu_check asks 512)."""
    write_probe(tmp_path, {}, rows=(512,))
    faster_at_2048 = tmp_path / "tall"
    faster_at_2048.mkdir()
    write_probe(faster_at_2048, {GROUPED_TMA: 0.8}, rows=(2048,))
    chunks = [*json.loads((tmp_path / PROBE_JSON).read_text())["chunks"],
              *json.loads((faster_at_2048 / PROBE_JSON).read_text())["chunks"]]
    (tmp_path / PROBE_JSON).write_text(json.dumps({"chunks": chunks}))
    assert pick(tmp_path).key is None
    assert pick(tmp_path, rows=2048).key == "erpo-epi-256x128x64-w8-s3-tma"


def test_a_failing_variant_is_never_picked(tmp_path):
    write_probe(tmp_path, {PERSISTENT_TMA: 0.5, GROUPED_TMA: 0.95}, failing={PERSISTENT_TMA})
    assert pick(tmp_path).key == "erpo-epi-256x128x64-w8-s3-tma"  # the fastest passing one
    write_probe(tmp_path, {PERSISTENT_TMA: 0.5}, failing={PERSISTENT_TMA})
    chosen = pick(tmp_path)
    assert chosen.key is None and "not faster than the library's on every shape" in chosen.why
    write_probe(tmp_path, {PERSISTENT_TMA: 0.5}, failing={LIBRARY})  # no passing baseline: nothing to beat
    assert pick(tmp_path) == (None, "none: the library's (d) (128x256x64 w8 s3, grouped) did not pass its check or "
                                    "was not timed at qwen2.5-7b, 512 rows")


def test_nothing_is_picked_when_the_lowest_sum_is_faster_on_one_shape_only(tmp_path):
    write_probe(tmp_path, {PERSISTENT_TMA: (0.7, 1.02), GROUPED_TMA: (0.99, 1.0)})
    chosen = pick(tmp_path)
    assert chosen.key is None and chosen.why.startswith("none: (d) 128x128x64 w4 s4, persistent (132), TMA "
                                                        "(erpo-epi-128x128x64-w4-s4-persistent132-tma) at 512 rows")
    assert "qwen2.5-32b 1.020" in chosen.why and "not faster than the library's on every shape" in chosen.why


def test_nothing_is_picked_without_both_shapes_512_row_chunks(tmp_path):
    chosen = pick(tmp_path)
    assert chosen == (None, f"none: no {PROBE_JSON} (the epilogue probe finished no chunk)")
    write_probe(tmp_path, {PERSISTENT_TMA: 0.9}, shapes=SHAPES[:1])  # stopped at its limit within the 32b shape
    assert pick(tmp_path) == (None, f"none: no chunk of 512 rows at qwen2.5-32b in {PROBE_JSON}")
    (tmp_path / PROBE_JSON).write_text('{"chunks": ')  # cut short: the lease goes on without a pick
    chosen = pick(tmp_path)
    assert chosen.key is None and chosen.why.startswith(f"none: {PROBE_JSON} unreadable (JSONDecodeError: ")

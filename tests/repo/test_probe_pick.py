"""bench.probe_pick: from a fused_probe.json (written here as bench.fused_probe writes it), the 1 GiB chunk/group
geometry with the lowest sum of median ratios to the library default is picked only when it is faster on every
shape; the workspace and host-layout variants never are; a missing file picks nothing."""
import json

from bench.fused_probe import VARIANTS
from bench.probe_pick import DEFAULT_VARIANT, PROBE_JSON, pick_geometry

SHAPES = ("qwen2.5-7b", "qwen2.5-32b")
DEFAULT_MS = {"qwen2.5-7b": 93.2, "qwen2.5-32b": 132.7}


def write_probe(folder, ratios: dict) -> None:
    """fused_probe.json with every variant at its shape's default median times ratios[variant name] (a number, or
    one per shape), 1.0 for the variants not named."""
    shapes = {}
    for index, shape in enumerate(SHAPES):
        shapes[shape] = []
        for variant in VARIANTS:
            ratio = ratios.get(variant.name, 1.0)
            median = DEFAULT_MS[shape] * (ratio[index] if isinstance(ratio, tuple) else ratio)
            shapes[shape].append({"variant": variant.name, "rows": variant.rows, "group": variant.group,
                                  "gib": variant.gib, "host_layout": variant.host_layout,
                                  "chunk_rows": variant.rows or 512, "group_rows": variant.group or 2048,
                                  "median_ms": median, "p20_ms": median, "p80_ms": median})
    (folder / PROBE_JSON).write_text(json.dumps({"meta": {}, "shapes": shapes}))


def test_the_geometry_faster_on_both_shapes_with_the_lowest_sum_is_picked(tmp_path):
    write_probe(tmp_path, {"chunk rows 256, group 2304": 0.96, "chunk rows 384": (0.97, 0.99),
                           "workspace 2 GiB": 0.9, "host layout (the trainer's call)": 0.8})
    pick = pick_geometry(tmp_path / PROBE_JSON)
    assert pick.key == "erpo-geom-256-2304" and pick.why.startswith("erpo-geom-256-2304: 'chunk rows 256, group 2304'")
    assert "qwen2.5-7b 0.960, qwen2.5-32b 0.960, sum 1.920" in pick.why
    assert "faster than the library default on every shape" in pick.why
    write_probe(tmp_path, {"chunk rows 256": 0.98})  # without a group cap: the chunk rows alone
    assert pick_geometry(tmp_path / PROBE_JSON).key == "erpo-geom-256"


def test_nothing_is_picked_when_the_lowest_sum_is_faster_on_one_shape_only(tmp_path):
    write_probe(tmp_path, {"chunk rows 256": (0.90, 1.02), "chunk rows 384": (0.99, 0.99), "workspace 4 GiB": 0.8})
    pick = pick_geometry(tmp_path / PROBE_JSON)
    assert pick.key is None and pick.why.startswith("none: 'chunk rows 256' (erpo-geom-256)")
    assert "qwen2.5-32b 1.020" in pick.why and "not faster than the library default on every shape" in pick.why


def test_nothing_is_picked_without_the_probe_s_results(tmp_path):
    pick = pick_geometry(tmp_path / PROBE_JSON)
    assert pick.key is None and pick.why == f"none: no {PROBE_JSON} (the probe did not finish)"
    write_probe(tmp_path, {"chunk rows 256": 0.9})
    measured = json.loads((tmp_path / PROBE_JSON).read_text())
    measured["shapes"]["qwen2.5-32b"] = [row for row in measured["shapes"]["qwen2.5-32b"]
                                         if row["variant"] != DEFAULT_VARIANT]
    (tmp_path / PROBE_JSON).write_text(json.dumps(measured))
    assert pick_geometry(tmp_path / PROBE_JSON) == (None, f"none: no {DEFAULT_VARIANT!r} row for qwen2.5-32b")
    (tmp_path / PROBE_JSON).write_text('{"shapes": ')  # cut short: the lease goes on without a pick
    pick = pick_geometry(tmp_path / PROBE_JSON)
    assert pick.key is None and pick.why.startswith(f"none: {PROBE_JSON} unreadable (JSONDecodeError: ")

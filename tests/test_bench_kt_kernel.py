"""The kt-kernel comparison's own logic (its timings need kt-kernel and an AMX host: the device):
how a side's process that dies part way is reported, and how wrong results show in the table."""

import argparse
import json
import sys

import torch

from benchmarks import bench_kt_kernel as bkk


def test_kt_int4_groups_round_trips_within_half_a_step():
    """kt-kernel's pre-quantised grouped int4 as the bench writes it: eight nibbles q + 8 to an
    int32 (input j at bits 4 * (j % 8)), one bf16 scale per group; decoding it gives back the
    weights within half a quantisation step (plus the bf16 scale's rounding)."""
    w = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(0)).bfloat16()
    words, scales = bkk.kt_int4_groups(w, 64)
    assert words.dtype == torch.int32 and words.shape == (2, 3, 16)
    assert scales.dtype == torch.bfloat16 and scales.shape == (2, 3, 2)
    nib = torch.stack([(words >> (4 * j)) & 15 for j in range(8)], -1).reshape(2, 3, 128)
    back = (nib.float() - 8).view(2, 3, 2, 64) * scales.float().unsqueeze(-1)
    step = scales.float().unsqueeze(-1)
    # rounding to the nearest step (|q| <= 7: scale = max |w| / 7), then |q| <= 7 times the bf16
    # scale's own rounding (2^-9 relative)
    assert ((back - w.float().view(2, 3, 2, 64)).abs() <= (0.5 + 7 / 512) * step * 1.01).all()


def test_table_marks_wrong_results_and_gives_each_ratio():
    rows = [
        {"model": "m", "T": 8, "method": "em-int4", "ms": 1.0, "rel_err": 0.19},
        {"model": "m", "T": 8, "method": "kt-AMXINT4", "ms": 1.2, "rel_err": 0.27},
        {"model": "m", "T": 8, "method": "kt-AMXINT4-G64", "ms": 2.0, "rel_err": float("nan")},
    ]
    text = bkk.table(rows, ["em-int4", "kt-AMXINT4", "kt-AMXINT4-G64"])
    line = text.splitlines()[-1]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[2] == "1.000 (1.20x; same groups 2.00x)"
    assert cells[3] == "1.200"
    assert cells[4].startswith("2.000") and "WRONG (rel err nan)" in cells[4]


def test_a_side_that_dies_part_way_keeps_its_rows_and_is_reported(monkeypatch, capsys):
    """child_rows keeps the rows printed before a crash (here SIGSEGV) and gives the signal;
    isolated() reports it on stderr and goes on with the other side's passes."""
    row = {"model": "m", "T": 8, "method": "kt-AMXINT4", "ms": 1.5, "rel_err": 0.27}
    script = f"import json, os, signal; print(json.dumps({row!r})); print('{{not json'); os.kill(os.getpid(), signal.SIGSEGV)"
    rows, rc = bkk.child_rows([sys.executable, "-c", script])
    assert rows == [row] and rc == -11

    calls = []

    def fake(cmd):
        methods = cmd[cmd.index("--methods") + 1]
        calls.append(methods)
        if methods.startswith("kt-"):
            return [row], -11
        ms = 1.0 + len(calls) / 10
        return [{"model": "m", "T": 8, "method": "em-int4", "ms": ms, "rel_err": 0.19}], 0

    monkeypatch.setattr(bkk, "child_rows", fake)
    args = argparse.Namespace(
        threads=2,
        models="m",
        tokens="8",
        reps=1,
        budget_s=0.1,
        kt_variant="amx",
        kt_dir="/x",
        warm=False,
        isolate=2,
    )
    out = bkk.isolated(args, ["em-int4", "kt-AMXINT4"])
    assert calls == ["em-int4", "kt-AMXINT4", "em-int4", "kt-AMXINT4"]
    by = {r["method"]: r for r in out}
    assert by["em-int4"]["ms_passes"] == [1.1, 1.3] and by["em-int4"]["ms"] == 1.1
    assert by["kt-AMXINT4"]["ms_passes"] == [1.5, 1.5]
    err = capsys.readouterr().err
    assert err.count("ended with signal SIGSEGV; 1 of its rows came before") == 2
    json.dumps(out)  # the rows stay writable as --out writes them

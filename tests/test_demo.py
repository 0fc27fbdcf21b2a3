"""The demo runs end to end on a small slice of the digits, and refuses bad options clearly."""

from __future__ import annotations

from pathlib import Path

import pytest

from pergrad.cli import main


def test_demo_prints_the_table_and_saves_the_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["demo", "--epochs", "2", "--limit", "400", "--out", str(tmp_path), "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0
    header, _, plain, clipped = out.strip().splitlines()[:4]
    assert header.split() == ["run", "test", "acc", "s/epoch", "||g_i||", "p50", "p90", "p99", "CABS", "batch"]
    assert plain.split()[0] == "plain" and clipped.split()[0] == "clipped"
    # norms are measured before clipping; accuracy is a fraction, CABS is clipped to [16, 2048]
    for row in (plain, clipped):
        cells = row.split()
        assert 0.0 <= float(cells[1]) <= 1.0
        assert 16 <= int(cells[-1]) <= 2048
    png = tmp_path / "pergrad-demo.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_with_noise(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["demo", "--epochs", "1", "--limit", "200", "--noise", "1.0", "--out", str(tmp_path), "--no-progress"])
        == 0
    )
    assert "clipped" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--epochs", "0"], "must be a positive integer"),
        (["--clip", "-1"], "must be a positive number"),
        (["--noise", "-0.5"], "must be >= 0"),
        (["--device", "tpu"], "device"),
        (["--device", "cuda:0"], "cuda"),
    ],
)
def test_bad_options_exit_non_zero_with_a_message(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    if args[-1].startswith("cuda") and torch.cuda.is_available():
        pytest.skip("a CUDA device is available, so --device cuda is valid here")
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err

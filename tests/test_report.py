"""``postrl report``: runs overlaid in one PNG; bad inputs named by file and line."""

from __future__ import annotations

import json

import pytest

from postrl.cli import main
from postrl.config.run import ConfigError
from postrl.run.report import load_run, panels_for, write_report


def write_run(folder, rows):
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_two_runs_overlaid_with_the_panels_they_have(tmp_path):
    a = write_run(
        tmp_path / "a" / "lr1",
        [
            {
                "step": s,
                "reward/mean": 0.1 * s,
                "accuracy": 0.1 * s,
                "actor/kl": 0.01,
                "time/train_s": 1.0,
                "time/generate_s": 2.0,
                "time/reward_s": 0.1,
                "time/sync_s": 0.2,
                "time/step_s": 3.3,  # five lines in one panel: the fifth line style too
            }
            for s in (1, 2, 3)
        ],
    )
    b = write_run(tmp_path / "b" / "lr1", [{"step": s, "reward/mean": 0.2 * s, "actor/grad_norm": 0.5} for s in (1, 2)])
    runs = [load_run(str(a)), load_run(str(b))]
    titles = {title: [key for key, _ in keys] for title, keys, _ in panels_for(runs)}
    assert titles == {
        "reward and accuracy": ["reward/mean", "accuracy"],
        "KL to the reference": ["actor/kl"],
        "grad norm": ["actor/grad_norm"],
        "phase seconds": ["time/generate_s", "time/reward_s", "time/train_s", "time/sync_s", "time/step_s"],
    }
    assert runs[1].series("reward/mean") == ([1, 2], [0.2, 0.4])
    out = write_report([str(a), str(b)], tmp_path / "cmp.png")
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(out).shape
    assert width > 1000 and height > 500  # two rows of three panels
    assert main(["report", str(a)]) == 0 and (a / "report.png").is_file()


def test_bad_inputs_name_the_file_and_line(tmp_path, capsys):
    with pytest.raises(ConfigError, match="no metrics.jsonl"):
        load_run(str(tmp_path))
    bad = write_run(tmp_path / "bad", [{"step": 1, "reward/mean": 0.5}])
    with (bad / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2, "reward/mean": \n')
    with pytest.raises(ConfigError, match=r"bad/metrics.jsonl:2: invalid JSON at column 28"):
        load_run(str(bad))
    assert main(["report", str(bad)]) == 2
    assert "metrics.jsonl:2" in capsys.readouterr().err

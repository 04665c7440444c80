"""`phyai-edge bench --rtc MODE` times chunks as the daemon's later ones run: every timed call
carries Real-Time Chunking guidance made from a chunk of the policy's own."""

from __future__ import annotations

import json

import pytest
import torch

from phyai_edge.cli import main as cli
from phyai_edge.commands.bench import BENCH_RTC_DELAY
from phyai_edge.engines.eager import EagerEngine


@pytest.mark.parametrize("mode", ["none", "guided", "inpaint"])
def test_bench_times_every_call_with_the_rtc_mode(mode, monkeypatch, capsys) -> None:
    seen = []
    run = EagerEngine.run

    def recording(self, inputs, noise=None, rtc=None):
        seen.append(rtc)
        return run(self, inputs, noise=noise, rtc=rtc)

    monkeypatch.setattr(EagerEngine, "run", recording)
    assert cli(["bench", "--preset", "tiny", "--rtc", mode, "--iters", "3", "--warmup", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["rtc"] == mode
    if mode == "none":
        assert seen == [None] * 4
        return
    first, *timed = seen
    assert first is None  # the chunk whose rest is the prefix
    assert len(timed) == 4 and all(g is not None and g.mode == mode for g in timed)
    h = timed[0].target.shape[1]
    assert timed[0].delay == BENCH_RTC_DELAY
    # the prefix: the rest of that chunk after H / 2 actions, normalised into model space; zero past it
    rows = timed[0].target[0].abs().sum(dim=1)
    assert bool((rows[: h - h // 2] > 0).all()) and bool((rows[h - h // 2:] == 0).all())
    assert all(torch.equal(g.target, timed[0].target) for g in timed)

"""bench/p9_admission.py: P9's stream over two simulated engines, admitting on the first chunk or the whole prompt."""

from __future__ import annotations

import random

from bench import p9_admission as adm
from bench.scenarios import p09_kv_pressure as p9
from bench.capacity import EngineSpec, blocks_for_tokens


def test_long_prompts_with_short_answers_preempt_only_when_the_first_chunk_admits_them():
    """3,000-token prompts of 24 blocks with 240-token answers on 91 blocks: admitted on their first chunk (16
    blocks) they outgrow the cache a step later; admitted whole they barely grow (2 blocks each)."""
    blocks = str(blocks_for_tokens(EngineSpec.of("tiny-cpu"), round(3.8 * 3240)))
    stream = p9.mix_stream(random.Random(9), rate=8.0, t_mix=0.0, duration=4.0)
    on_chunk = EngineSpec.of("tiny-cpu", ["--num-gpu-blocks", blocks, "--no-scheduler-reserve-full-isl"])
    chunk, _ = adm.preemptions(on_chunk, stream, (3000, 240), deadline_s=60.0)
    whole, late = adm.preemptions(EngineSpec.of("tiny-cpu", ["--num-gpu-blocks", blocks]), stream, (3000, 240),
                                  deadline_s=60.0)
    assert chunk >= 5 and whole <= chunk // 4
    assert late == 0                                                        # every request finished by 60 s


def test_main_prints_one_row_per_seed(capsys):
    assert adm.main(["--seeds", "1", "--preset", "tiny-cpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("long 800+640") and len(out) == 3 and out[2].split()[0] == "9"

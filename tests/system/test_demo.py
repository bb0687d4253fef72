"""``swarmd demo``'s words: what the trainer's counters say about a kill, in a newcomer's terms.

The whole demo (five processes, a minute) runs as ``./scripts/demo``; here, the sentences it builds
from a trainer's summary: one per thing that happened, none for what did not, no protocol terms.
"""

from __future__ import annotations

from swarmd.cli.demo import _what_the_churn_cost
from swarmd.train.trainer import TrainSummary

JARGON = ("stale", "top-up", "redo", "claim", "backward", "microbatch", "lease")


def test_an_undisturbed_run_says_only_that_everything_came_back() -> None:
    calm = TrainSummary(microbatches_issued=240, microbatches_completed=240)
    assert _what_the_churn_cost(calm) == ["the trainer sent 240 batches of samples through the pipeline and every "
                                          "one came back, none lost"]


def test_each_cost_of_a_kill_is_one_plain_sentence() -> None:
    hit = TrainSummary(microbatches_issued=390, microbatches_completed=388, retries=2, topup_microbatches=1,
                       stale_redos=6)
    lines = _what_the_churn_cost(hit)
    assert len(lines) == 4 and lines[0].endswith("and 388 of them came back")
    assert lines[1].startswith("  2 request(s) failed on a dead or busy peer and were sent to another peer")
    assert lines[2].startswith("  1 extra batch(es) replaced the work the killed peer took with it")
    assert lines[3].startswith("  6 batch(es) were computed again because their stage had taken a step")
    assert not [word for word in JARGON for line in lines if word in line.lower()]

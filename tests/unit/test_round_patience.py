"""swarmd.pipeline.averaging.patience: how long a leader waits for its stage-mates (pure, times given)."""

from __future__ import annotations

from swarmd.pipeline.averaging.patience import CatchUp, RoundPatience


def test_the_round_timeout_holds_until_enough_rounds_then_the_median_and_each_peer_s_slowest() -> None:
    patience = RoundPatience(factor=4.0, floor_s=3.0, min_samples=3)
    assert patience.wait_s(30.0) == 30.0
    patience.observe({"b": 0.2, "c": 0.3})
    assert patience.wait_s(30.0) == 30.0  # two delays: not enough yet
    patience.observe({"b": 2.0})
    assert patience.wait_s(30.0) == 3.0  # 4 x the median (0.3) is under the floor
    assert patience.wait_s(30.0, expected=["b"]) == 8.0  # b took 2 s once: waited for as it always was
    assert patience.wait_s(5.0, expected=["b"]) == 5.0  # never past the round timeout
    assert RoundPatience.silent({"a", "b", "c"}, {"b"}, leader="a") == {"c"}


def test_a_leader_holds_off_for_its_last_round_s_contributors_while_they_apply_its_answer() -> None:
    """Issue 28 at wan100: under delayed updates the leader alone holds a full batch again once it
    stepped; opening the next round while its contributor still applies the answer (one step behind)
    would step without it and leave it behind to resync, its samples dropped."""
    catch_up = CatchUp()
    assert not catch_up.holds_off(5, {"b": 4}, now=0.0, grace_s=2.0)  # no round led yet: nobody to wait for
    catch_up.stepped(4, {"b"})
    assert catch_up.behind(5, {"b": 4, "c": 5}) == {"b"}
    assert catch_up.holds_off(5, {"b": 4}, now=0.0, grace_s=2.0)
    assert catch_up.holds_off(5, {"b": 4}, now=1.9, grace_s=2.0)
    assert not catch_up.holds_off(5, {"b": 4}, now=2.1, grace_s=2.0)  # the grace is over: it goes on without b
    assert not catch_up.holds_off(5, {"b": 5}, now=0.5, grace_s=2.0)  # b applied it: the round may open


def test_only_the_last_round_s_contributors_one_step_behind_are_waited_for() -> None:
    catch_up = CatchUp()
    catch_up.stepped(4, {"b"})
    # a peer that was not in the round (a fake that never contributes, a newcomer) costs nothing
    assert not catch_up.holds_off(5, {"c": 4}, now=0.0, grace_s=2.0)
    # two steps behind: it lost answers and resyncs from the stage, it is not applying this one
    assert not catch_up.holds_off(5, {"b": 3}, now=0.0, grace_s=2.0)
    assert not catch_up.holds_off(5, {}, now=0.0, grace_s=2.0)  # b did not answer the poll
    # a round led at another step (this peer was a contributor since) names no one
    assert not catch_up.holds_off(7, {"b": 6}, now=0.0, grace_s=2.0)


def test_the_grace_starts_again_at_each_step() -> None:
    catch_up = CatchUp()
    catch_up.stepped(4, {"b"})
    assert catch_up.holds_off(5, {"b": 4}, now=0.0, grace_s=2.0)
    catch_up.stepped(5, {"b"})
    assert catch_up.holds_off(6, {"b": 5}, now=10.0, grace_s=2.0)
    assert not catch_up.holds_off(6, {"b": 5}, now=12.5, grace_s=2.0)


def test_a_contributor_that_made_the_leader_wait_in_vain_is_not_waited_for_again_for_a_while() -> None:
    """A proven contributor that claims to be a step behind for good (a liar, or a frozen peer) costs
    one grace, not one per round: it is not waited for again for ``forget_after`` rounds."""
    catch_up = CatchUp(forget_after=3)
    catch_up.stepped(4, {"b", "c"})
    assert catch_up.holds_off(5, {"b": 4, "c": 4}, now=0.0, grace_s=2.0)
    assert not catch_up.holds_off(5, {"b": 4, "c": 5}, now=2.5, grace_s=2.0)  # b never came: in vain
    for step in (6, 7, 8):
        catch_up.stepped(step - 1, {"b", "c"})
        assert catch_up.behind(step, {"b": step - 1, "c": step - 1}) == {"c"}  # c is still waited for
    catch_up.stepped(8, {"b"})
    assert catch_up.holds_off(9, {"b": 8}, now=100.0, grace_s=2.0)  # forgotten after 3 rounds: waited for again

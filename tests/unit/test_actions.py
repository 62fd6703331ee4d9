"""Per-token advantage estimators on a trajectory's actions (``rlbatch.algos.advantages.Actions``):
observation tokens are no action of the policy's, so returns and GAE step over them, whitening
leaves them out, and they get 0."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from rlbatch.algos.advantages import Actions
from rlbatch.algos.registry import ADVANTAGES
from rlbatch.envs.trajectories import action_masks, spans

ALGO = SimpleNamespace(kl_coef=0.1, gamma=0.9, lam=0.8, adv_eps=1e-8, whiten_advantages=True)
# two trajectories: action action obs obs action | action obs action
MASKS = [[1, 1, 0, 0, 1], [1, 0, 1]]


def _actions() -> Actions:
    return Actions([torch.tensor(m) for m in MASKS])


def test_spans_rebuild_the_loss_mask_on_the_controller() -> None:
    assert spans(MASKS[0]) == [(0, 2), (4, 1)] and spans([0, 0]) == [] and spans([1, 1]) == [(0, 2)]
    episodes = {7: {"spans": [[0, 2], [4, 1]]}, 9: {"spans": spans(MASKS[1])}}  # lists: as a checkpoint's JSON
    got = action_masks(episodes, [7, 9], [5, 3])
    assert got is not None and [m.int().tolist() for m in got] == MASKS
    assert action_masks({}, [7], [5]) is None


def test_reinforce_pp_runs_on_the_actions_alone() -> None:
    rewards = torch.tensor([1.0, 0.0])
    kl = [torch.tensor([0.5, 0.2, 0.0, 0.0, 0.1]), torch.tensor([0.3, 0.0, 0.4])]
    got = _actions().estimate(ADVANTAGES.get("reinforce_pp"), rewards, 2, ALGO, kl=kl)
    # the same estimator on the compressed responses: lengths 3 and 2
    want = ADVANTAGES.get("reinforce_pp")(rewards, 2, ALGO, lengths=[3, 2],
                                          kl=[torch.tensor([0.5, 0.2, 0.1]), torch.tensor([0.3, 0.4])])
    assert torch.equal(got[0][torch.tensor(MASKS[0]).bool()], want[0]) and torch.equal(got[1][[0, 2]], want[1])
    assert got[0][2:4].tolist() == [0.0, 0.0] and got[1][1].item() == 0.0
    # through the observations instead (every token an action): a different answer
    naive = ADVANTAGES.get("reinforce_pp")(rewards, 2, ALGO, lengths=[5, 3], kl=kl)
    assert not torch.allclose(naive[0], got[0])


def test_gae_steps_from_one_action_to_the_next_across_observations() -> None:
    rewards = torch.tensor([1.0, 0.0])
    values = [torch.tensor([0.1, 0.2, 9.0, 9.0, 0.4]), torch.tensor([0.5, 9.0, 0.6])]  # 9: never read
    algo = SimpleNamespace(**vars(ALGO) | {"whiten_advantages": False})
    adv, ret = _actions().estimate(ADVANTAGES.get("gae"), rewards, 2, algo, values=values)
    g, lam = ALGO.gamma, ALGO.lam
    # trajectory 0's actions: values 0.1, 0.2, 0.4; reward 1 on the last
    d2 = 1.0 - 0.4
    d1 = 0.0 + g * 0.4 - 0.2
    d0 = 0.0 + g * 0.2 - 0.1
    a2, a1 = d2, d1 + g * lam * d2
    a0 = d0 + g * lam * a1
    assert torch.allclose(adv[0], torch.tensor([a0, a1, 0.0, 0.0, a2]), atol=1e-6), adv[0]
    assert torch.allclose(ret[0], torch.tensor([a0 + 0.1, a1 + 0.2, 0.0, 0.0, a2 + 0.4]), atol=1e-6)
    assert adv[1][1].item() == 0.0 and ret[1][1].item() == 0.0


def test_sequence_level_estimators_are_unchanged() -> None:
    rewards = torch.tensor([1.0, 0.0])
    assert torch.equal(_actions().estimate(ADVANTAGES.get("grpo"), rewards, 2, ALGO),
                       ADVANTAGES.get("grpo")(rewards, 2, ALGO, lengths=[5, 3]))


def test_per_turn_rewards_sit_at_their_turns_for_the_estimators_that_take_them() -> None:
    """Trajectory 0 earns 0.25 after its first turn (actions 0-1) and 0.75 in all: GAE credits the
    first turn's tokens with its reward by hand; the rest (0.5, other scorers' and the last turn's)
    stays on the last action; GRPO sees the sums; an estimator without the keyword runs as before."""
    rewards = torch.tensor([0.75, 0.0])
    turns = [[(1, 0.25)], []]  # (index among the actions, reward), as turn_rewards_of gives them
    values = [torch.tensor([0.1, 0.2, 9.0, 9.0, 0.4]), torch.tensor([0.5, 9.0, 0.6])]
    algo = SimpleNamespace(**vars(ALGO) | {"whiten_advantages": False})
    adv, _ = Actions([torch.tensor(m) for m in MASKS], turns).estimate(ADVANTAGES.get("gae"), rewards, 2, algo,
                                                                        values=values)
    g, lam = ALGO.gamma, ALGO.lam
    d2 = 0.5 - 0.4
    d1 = 0.25 + g * 0.4 - 0.2
    d0 = 0.0 + g * 0.2 - 0.1
    a1 = d1 + g * lam * d2
    assert torch.allclose(adv[0], torch.tensor([d0 + g * lam * a1, a1, 0.0, 0.0, d2]), atol=1e-6), adv[0]
    with_turns = Actions([torch.tensor(m) for m in MASKS], turns)
    unplaced = ADVANTAGES.get("reinforce_pp")(rewards, 2, ALGO, lengths=[3, 2])
    placed = with_turns.estimate(ADVANTAGES.get("reinforce_pp"), rewards, 2, ALGO)
    assert not torch.allclose(placed[0][torch.tensor(MASKS[0]).bool()], unplaced[0])
    assert torch.equal(with_turns.estimate(ADVANTAGES.get("grpo"), rewards, 2, ALGO),
                       ADVANTAGES.get("grpo")(rewards, 2, ALGO, lengths=[5, 3]))

    def plain(rewards: torch.Tensor, group_size: int, algo: object, *, lengths: list[int],
              kl: object = None) -> list[torch.Tensor]:
        return [torch.full((n,), float(r)) for r, n in zip(rewards, lengths, strict=True)]

    assert [t.tolist() for t in with_turns.estimate(plain, rewards, 2, ALGO)] == [[0.75, 0.75, 0, 0, 0.75], [0, 0, 0]]


def test_a_trajectory_reports_each_turns_reward_at_its_last_generated_token() -> None:
    from rlbatch.envs.rollout import Trajectory
    from rlbatch.envs.trajectories import summary, turn_rewards_of

    traj = Trajectory(0, [1], response=[5, 6, 0, 7], loss_mask=[1, 1, 0, 1], rewards=[0.25, 0.0, 0.5],
                      reward_at=[2, 3, 3], generated=3)
    s = summary(traj)
    assert s["turn_rewards"] == [(1, 0.25), (2, 0.5)] and s["reward"] == 0.75
    assert turn_rewards_of({4: s}, [4]) == [[(1, 0.25), (2, 0.5)]] and turn_rewards_of({}, [4]) is None

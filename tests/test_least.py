import numpy as np
import pytest

from plasticity_zoo.plasticity.least import LEAST, History, should_stop


def test_stop_rule_hand_cases():
    q_hist, g_hist = np.array([10.0, 20.0, 30.0]), np.array([1.0, 2.0, 3.0])  # eps = 20, median G = 2
    # coef 1: omega = 2 / G; stop iff Q < omega * eps
    assert should_stop(39.0, 1.0, q_hist, g_hist, coef=1.0)  # omega 2 -> threshold 40
    assert not should_stop(41.0, 1.0, q_hist, g_hist, coef=1.0)
    assert not should_stop(15.0, 4.0, q_hist, g_hist, coef=1.0)  # omega 0.5 -> threshold 10 (looser)
    assert should_stop(9.0, 4.0, q_hist, g_hist, coef=1.0)
    # coef 0.5 halves omega: threshold 20 for G = 1
    assert should_stop(19.0, 1.0, q_hist, g_hist, coef=0.5) and not should_stop(21.0, 1.0, q_hist, g_hist, coef=0.5)
    # negative threshold: stop iff Q < eps / omega
    neg = -q_hist  # eps = -20
    assert should_stop(-41.0, 4.0, neg, g_hist, coef=1.0)  # omega 0.5 -> threshold -40
    assert not should_stop(-39.0, 4.0, neg, g_hist, coef=1.0)
    # NaN-padded columns (episodes that ended earlier) are ignored; empty history never stops
    assert should_stop(39.0, 1.0, np.array([10.0, np.nan, 20.0, 30.0]), np.array([1.0, 2.0, np.nan, 3.0]), coef=1.0)
    assert not should_stop(-1e9, 1.0, np.array([np.nan]), np.array([np.nan]))


def test_least_stops_exactly_where_the_constructed_history_says():
    least = LEAST(seeds=1, envs_per_seed=1, window=4, max_len=10, warmup_steps=0, min_episodes=2, coef=1.0)
    never = np.array([True])
    # first call aligns the env at an episode boundary
    assert not least.decide(0, np.array([0.0]), np.array([1.0]), never).any()
    # two full episodes of length 5 with Q = 10 at every step and TD loss 1
    for _ in range(2):
        for t in range(5):
            least.decide(1, np.array([10.0]), np.array([1.0]), np.array([t == 4]))
    assert least.histories[0].count == 2
    # third episode: Q stays at 10 for 2 steps, then drops to 5 (< omega * eps = 1 * 10) at step index 2
    out = [bool(least.decide(1, np.array([q]), np.array([1.0]), np.array([False]))[0]) for q in (10.0, 10.0, 5.0)]
    assert out == [False, False, True] and least.stops == 1
    # the stopped episode went into the history (3 steps, NaN after)
    h = least.histories[0]
    assert h.count == 3 and np.isnan(h.q[2, 3]) and h.q[2, 2] == 5.0


def test_warmup_and_min_episodes_prevent_stops():
    least = LEAST(seeds=1, envs_per_seed=1, window=4, max_len=10, warmup_steps=100, min_episodes=1, coef=1.0)
    least.decide(0, np.array([0.0]), np.array([1.0]), np.array([True]))
    for t in range(3):
        least.decide(1, np.array([10.0]), np.array([1.0]), np.array([t == 2]))
    assert not least.decide(50, np.array([-100.0]), np.array([1.0]), np.array([False])).any()  # warm-up
    assert least.decide(150, np.array([-100.0]), np.array([1.0]), np.array([False])).any()


def test_history_window_is_a_ring():
    h = History(window=2, max_len=3)
    for k in range(3):
        h.push(np.full(3, float(k)), np.ones(3))
    assert sorted(h.q[:, 0].tolist()) == [1.0, 2.0]


@pytest.mark.slow
def test_least_on_sac_stores_stopped_episodes_as_truncated(tiny_sac_config, tmp_path):
    import csv

    import jax

    from plasticity_zoo.agents import sac
    from plasticity_zoo.training.config import PlasticityConfig
    from plasticity_zoo.training.loops.offpolicy import train

    pcfg = PlasticityConfig(metrics_every=0, least=True, least_warmup=0.0, least_window=20)
    cfg = tiny_sac_config(total_steps=1200, env="InvertedPendulum-v5", plasticity=pcfg, checkpoint_every=1200)
    train(cfg, sac, tmp_path / "r")
    rows = list(csv.DictReader(open(tmp_path / "r" / "metrics.csv")))
    stops = max(float(r["plasticity/least_stops"]) for r in rows)
    assert stops > 0
    from plasticity_zoo.training import checkpoint
    from plasticity_zoo.training.loops.offpolicy import init_state

    (_, buffer, _), host, _ = checkpoint.load(checkpoint.latest(tmp_path / "r"), init_state(sac, cfg, 4, 1))
    data = jax.tree.map(lambda x: np.asarray(x[0]), buffer.data)
    n = int(np.asarray(buffer.size)[0])
    # every LEAST stop is a stored transition marked truncated and not terminated
    assert np.sum(data.truncated[:n] & ~data.terminated[:n]) >= stops
    assert host["least"].stops == stops


def test_noise_rises_with_the_share_of_early_stops():
    least = LEAST(seeds=2, envs_per_seed=1)
    least.ended = [[False] * 20, [True] * 20]
    low, high = least.noise(0.2, 0.3)
    assert low == pytest.approx(0.2, abs=1e-3) and high == pytest.approx(0.3, abs=1e-3)
    least.ended = [[True, False] * 10, []]
    assert least.noise(0.2, 0.3)[0] == pytest.approx(0.25)


def test_noise_increase_is_refused_without_exploration_noise():
    from plasticity_zoo.agents import sac
    from plasticity_zoo.plasticity.hooks import check_applicable
    from plasticity_zoo.training.config import PlasticityConfig

    with pytest.raises(ValueError, match="no explicit exploration noise"):
        check_applicable(PlasticityConfig(least=True, least_noise_max=0.3), sac, "sac")

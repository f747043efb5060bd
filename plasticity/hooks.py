"""Where the training loop calls plasticity: metrics and resets every K updates, SIGReg in the loss.

An agent takes part by declaring its plastic networks: ``PLASTIC = {name: (params_field,
opt_state_field)}``, ``plastic_params(state)``, ``plastic_losses(state, batch, key)`` (each
network's training loss as a function of its params) and a state field ``name`` holding the
``Net`` (or ``plastic_nets(state)``).  SIGReg additionally needs the agent to wrap those
losses with ``plasticity.sigreg.regularized`` and list them in ``SIGREG_NETWORKS``.  Kron and
NE need the agent to build its plastic networks' optimizers with ``plasticity.optim.optimizer``
(``static_plasticity`` is what the loop builds the agent with: ``agent.init(..., plasticity)``).
Layer resets also re-draw the agent's target copies of the networks it names in ``PLASTIC_TARGETS``
({network: target params field}; optional), and plasticity injection gives them the injected pair.
Plasticity injection needs the agent to pass the networks it offers through
``plasticity.injection.injectable`` in its ``init`` (their heads then carry a residual pair from the
start); the event runs once, after the update count given by ``--plasticity.injection-step`` (or the
share ``--plasticity.injection-at`` of the run's updates).
Interventions an agent cannot take are refused with a clear error.

NE (``plasticity.expansion``) runs here every ``ne_every`` updates: its host-side ``Schedule``
picks the counts, one jitted event (compiled once) rewrites masks, params and moments, and the
critic's FAU measured at the event sets NE's replay controls that the loop passes to its sampler
until the next event (``replay_control``: the experience-review probability and the auto batch's
half-batch flag).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax

from plasticity_zoo.networks import instrument
from plasticity_zoo.networks.residual import has_residual
from plasticity_zoo.networks.runtime import cached_per_config
from plasticity_zoo.plasticity import expansion, injection, perturb, resets
from plasticity_zoo.plasticity import metrics as metrics_lib
from plasticity_zoo.plasticity import optim as optim_lib
from plasticity_zoo.plasticity import trac as trac_lib
from plasticity_zoo.plasticity.api import (
    ExplorationNoiseAgent,
    LEASTAgent,
    PlasticAgent,
    StaticPlasticity,  # noqa: F401
    measured,
    measured_losses,
    measured_params,
)
from plasticity_zoo.plasticity.config import PlasticityConfig
from plasticity_zoo.plasticity.sigreg import SIGRegSpec

# distinct buffers (the loop donates the state it measures later), in one dispatch: op by op, a
# copy per leaf, each its own in-flight computation
_copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))


def check_applicable(cfg: PlasticityConfig, agent, agent_name: str):
    """Raise a clear error for any requested intervention the agent cannot take."""
    cfg.validate()
    # metrics need plastic or measured networks (MeasuredAgent), interventions plastic ones
    wanted = [
        flag
        for flag, on in (
            ("--plasticity.metrics-every", cfg.metrics_every > 0 and not measured(agent)),
            ("--plasticity.redo", cfg.redo),
            ("--plasticity.regrama", cfg.regrama),
            ("--plasticity.sigreg-coef", cfg.sigreg_coef > 0),
            ("--plasticity.ne", cfg.ne),
            ("--plasticity.kron", cfg.kron),
            ("--plasticity.shrink-perturb", cfg.shrink_perturb),
            ("--plasticity.layer-reset", cfg.layer_reset),
            ("--plasticity.l2", cfg.l2 > 0),
            ("--plasticity.l2-init", cfg.l2_init > 0),
            ("--plasticity.parseval", cfg.parseval > 0),
            ("--plasticity.nap", cfg.nap),
            (injection_flag(cfg), cfg.injects),
            ("--plasticity.trac", cfg.trac),
        )
        if on
    ]
    if wanted and not isinstance(agent, PlasticAgent):
        why = (
            getattr(agent, "INTERVENTIONS_REFUSED", None) if measured(agent) else None
        ) or "it declares no plastic networks (plasticity.api.PlasticAgent)"
        raise ValueError(f"{', '.join(wanted)} does not apply to agent {agent_name!r}: {why}")
    if cfg.least and (agent.KIND != "offpolicy" or not isinstance(agent, LEASTAgent)):
        raise ValueError(
            f"--plasticity.least does not apply to agent {agent_name!r}: LEAST stops episodes of "
            "online off-policy agents from their Q and TD-loss histories (not on-policy or offline)"
        )
    if cfg.least_noise_max > 0 and not isinstance(agent, ExplorationNoiseAgent):
        raise ValueError(
            f"--plasticity.least-noise-max does not apply to agent {agent_name!r}: it has no "
            "explicit exploration noise to raise (SAC explores through its entropy term)"
        )
    if cfg.least_noise_max > 0 and not cfg.least:
        raise ValueError("--plasticity.least-noise-max is part of LEAST: add --plasticity.least")
    if cfg.sigreg_coef > 0 and not (isinstance(agent, PlasticAgent) and agent.SIGREG_NETWORKS):
        raise ValueError(
            f"--plasticity.sigreg-coef does not apply to agent {agent_name!r}: its losses "
            "expose no representation to regularise"
        )
    if cfg.ne and cfg.ne_review and not agent.EXPERIENCE_REVIEW:
        raise ValueError(
            f"--plasticity.ne-review does not apply to agent {agent_name!r}: experience review "
            f"draws from the oldest 30% of a uniform replay buffer and {_no_uniform_replay(agent)}; "
            "pass --plasticity.no-ne-review"
        )
    if cfg.ne and cfg.ne_auto_batch == "on" and not agent.EXPERIENCE_REVIEW:
        raise ValueError(
            f"--plasticity.ne-auto-batch on does not apply to agent {agent_name!r}: auto batch "
            f"halves the uniform replay batches of its updates and {_no_uniform_replay(agent)}; "
            "pass --plasticity.ne-auto-batch auto (off for this agent) or off"
        )


def _no_uniform_replay(agent) -> str:
    return {
        "onpolicy": "on-policy agents keep no replay",
        "offline": "offline agents learn from a fixed dataset, with no online stream to review",
    }.get(agent.KIND, "it samples its own replay (e.g. LAP)")


def auto_batch_on(cfg: PlasticityConfig, agent) -> bool:
    """NE's auto batch: ``on``, or ``auto`` for agents on the shared uniform replay (``EXPERIENCE_REVIEW``)."""
    return cfg.ne and (cfg.ne_auto_batch == "on" or (cfg.ne_auto_batch == "auto" and agent.EXPERIENCE_REVIEW))


def injection_flag(cfg: PlasticityConfig) -> str:
    """The flag that turned plasticity injection on, for messages."""
    return "--plasticity.injection-at" if cfg.injection_at and not cfg.injection_step else "--plasticity.injection-step"


def optim_spec(cfg: PlasticityConfig, agent) -> optim_lib.OptimSpec | None:
    """What ``plasticity.optim.optimizer`` builds for this run (None: the agents' defaults)."""
    reg = regularizer_spec(cfg)
    if not (cfg.kron or cfg.ne or reg or cfg.trac or cfg.injects):
        return None
    ne = optim_lib.NESpec(cfg.ne_initial_sparsity) if cfg.ne else None
    tracs = trac_lib.TracSpec(cfg.trac_s_init) if cfg.trac else None
    return optim_lib.OptimSpec(cfg.kron, ne, tuple(agent.PLASTIC) if cfg.ne else None, reg, tracs, cfg.injects)


def static_plasticity(cfg: PlasticityConfig, agent) -> StaticPlasticity:
    """What the agent is built with: its optimizers' Kron / NE masks / L2, L2 Init, Parseval, NaP / TRAC, SIGReg,
    and plasticity injection's residual heads."""
    spec = injection.InjectionSpec(cfg.injection_layers) if cfg.injects else None
    return StaticPlasticity(optim_spec(cfg, agent), sigreg_spec(cfg), spec)


def check_optimizers(cfg: PlasticityConfig, agent, agent_name: str, state):
    """After ``agent.init(..., static_plasticity(cfg, agent))``: refuse Kron / NE / the regularisers if the
    agent's plastic networks' optimizer states show it ignored them (built without
    ``plasticity.optim.optimizer``), or the agent has no plastic networks; refuse NaP on a network
    without LayerNorm.  ``state`` may be abstract (``jax.eval_shape``)."""
    if regularizer_spec(cfg) is not None:
        check_regularizers(cfg, agent, agent_name, state)
    if cfg.trac:
        check_trac(agent, agent_name, state)
    if cfg.injects:
        check_injection(cfg, agent, agent_name, state)
    if not (cfg.kron or cfg.ne):
        return
    opt_states = {name: getattr(state, o_field) for name, (_, o_field) in agent.PLASTIC.items()}
    if cfg.kron:
        adam = [name for name, opt in opt_states.items() if _has_adam_moments(opt)]
        if adam:
            raise ValueError(
                f"--plasticity.kron does not apply to agent {agent_name!r}: the optimizers of "
                f"{', '.join(adam)} are not built with plasticity.optim.optimizer"
            )
    missing = sorted(name for name, opt in opt_states.items() if optim_lib.find_masked(opt) is None) if cfg.ne else []
    if missing:
        raise ValueError(
            f"--plasticity.ne does not apply to agent {agent_name!r}: the optimizers of "
            f"{', '.join(missing)} are not built with plasticity.optim.optimizer"
        )


def check_trac(agent, agent_name: str, state):
    """Refuse TRAC where a plastic network's optimizer holds no TRAC state (not built by ``plasticity.optim``)."""
    missing = sorted(
        name for name, (_, o_field) in agent.PLASTIC.items() if trac_lib.find(getattr(state, o_field)) is None
    )
    if missing:
        raise ValueError(
            f"--plasticity.trac does not apply to agent {agent_name!r}: the optimizers of {', '.join(missing)} "
            "are not built with plasticity.optim.optimizer"
        )


def check_injection(cfg: PlasticityConfig, agent, agent_name: str, state):
    """Refuse plasticity injection on an agent that offers no network for it (``plasticity.injection.injectable``
    in its ``init``), or whose residual networks' optimizers ignore the frozen head."""
    flag = injection_flag(cfg)
    heads = [name for name, (p_field, _) in agent.PLASTIC.items() if has_residual(getattr(state, p_field))]
    if not heads:
        raise ValueError(
            f"{flag} does not apply to agent {agent_name!r}: none of its networks is built with a residual head "
            "(plasticity.injection.injectable in its init)"
        )
    missing = sorted(n for n in heads if injection.find(getattr(state, agent.PLASTIC[n][1])) is None)
    if missing:
        raise ValueError(
            f"{flag} does not apply to agent {agent_name!r}: the optimizers of {', '.join(missing)} are not built "
            "with plasticity.optim.optimizer, so their frozen heads would train"
        )


def _has_adam_moments(opt_state) -> bool:
    leaves = jax.tree_util.tree_leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
    return any(isinstance(x, optax.ScaleByAdamState) for x in leaves)


def sigreg_spec(cfg: PlasticityConfig) -> SIGRegSpec | None:
    return SIGRegSpec(cfg.sigreg_coef, cfg.sigreg_variant, cfg.sigreg_slices) if cfg.sigreg_coef > 0 else None


def _net(agent, state, name):
    return agent.plastic_nets(state)[name]


def reset_step(agent, cfg: PlasticityConfig, state, buffer, key):
    """One ReDo/ReGraMa event for one seed -> (state, {plasticity/<net>/reset_fraction})."""
    method, tau = ("redo", cfg.redo_tau) if cfg.redo else ("regrama", cfg.regrama_tau)
    k_batch, k_loss, k_init = jax.random.split(key, 3)
    batch = agent.sample_batch(state, buffer, k_batch, cfg.reset_batch)
    losses = agent.plastic_losses(state, batch, k_loss)
    params = agent.plastic_params(state)
    out = {}
    for i, (name, (p_field, o_field)) in enumerate(agent.PLASTIC.items()):
        loss = losses[name]
        net_params = params[name]
        scores = resets.scores(method, lambda: loss(net_params), name)
        masks = {tap: resets.select(s, tau, cfg.reset_max_fraction) for tap, s in scores.items()}
        new_params, new_opt = resets.reset_neurons(
            _net(agent, state, name),
            net_params,
            getattr(state, o_field),
            masks,
            jax.random.fold_in(k_init, i),
            cfg.reset_layer_norm,
        )
        state = state.replace(**{p_field: new_params, o_field: new_opt})
        n = sum(m.size for m in masks.values())
        out[f"plasticity/{name}/reset_fraction"] = sum(m.sum() for m in masks.values()) / n
    return state, out


def shrink_perturb_step(agent, cfg: PlasticityConfig, state, key):
    """One Shrink & Perturb event for one seed (``plasticity.perturb``) -> state.  Under NE the weights
    its masks hold at zero stay there."""
    for i, (name, (p_field, o_field)) in enumerate(agent.PLASTIC.items()):
        fresh = _net(agent, state, name).init(jax.random.fold_in(key, i))
        new = perturb.shrink_perturb(getattr(state, p_field), fresh, cfg.sp_shrink, cfg.sp_perturb)
        state = state.replace(**{p_field: optim_lib.apply_mask(getattr(state, o_field), new)})
    return state


def layer_reset_step(agent, cfg: PlasticityConfig, state, key):
    """One layer-reset event for one seed (``plasticity.perturb``) -> (state, {plasticity/<net>/layer_reset_fraction}).

    The agent's target copies of the networks (``PLASTIC_TARGETS``: {network: target params field})
    take the reset layers' new values."""
    targets = getattr(agent, "PLASTIC_TARGETS", {})
    out = {}
    for i, (name, (p_field, o_field)) in enumerate(agent.PLASTIC.items()):
        params, opt = getattr(state, p_field), getattr(state, o_field)
        new, new_opt, mask = perturb.reset_layers(
            _net(agent, state, name), params, opt, jax.random.fold_in(key, i), cfg.layer_reset_layers
        )
        new = optim_lib.apply_mask(new_opt, new)  # NE: the masked-out weights of the new layers stay 0
        state = state.replace(**{p_field: new, o_field: new_opt})
        if name in targets:
            t_field = targets[name]
            state = state.replace(
                **{t_field: jax.tree.map(lambda m, n, t: jnp.where(m, n, t), mask, new, getattr(state, t_field))}
            )
        sizes = [(m.sum(), m.size) for m in jax.tree.leaves(mask)]
        out[f"plasticity/{name}/layer_reset_fraction"] = sum(a for a, _ in sizes) / sum(b for _, b in sizes)
    return state, out


def injection_event(agent, state, key):
    """Plasticity injection for one seed (``plasticity.injection``) -> (state, {plasticity/<net>/injected}).

    Every plastic network with a residual head gets theta' from its own initialiser; the agent's target
    copies of it (``PLASTIC_TARGETS``) take the same pair, so targets are unchanged too."""
    targets = getattr(agent, "PLASTIC_TARGETS", {})
    out = {}
    for i, (name, (p_field, o_field)) in enumerate(agent.PLASTIC.items()):
        params = getattr(state, p_field)
        if not has_residual(params):
            continue
        new, new_opt = injection.inject(
            _net(agent, state, name), params, getattr(state, o_field), jax.random.fold_in(key, i)
        )
        state = state.replace(**{p_field: new, o_field: new_opt})
        if name in targets:
            t_field = targets[name]
            state = state.replace(**{t_field: injection.with_pair_of(getattr(state, t_field), new)})
        out[f"plasticity/{name}/injected"] = jnp.ones((), jnp.float32)
    return state, out


def review_network(agent) -> str:
    """The network whose FAU drives experience review: ``critic`` if plastic, else the first one."""
    return "critic" if "critic" in agent.PLASTIC else next(iter(agent.PLASTIC))


def ne_step(agent, cfg: PlasticityConfig, state, buffer, key, counts):
    """One NE event for one seed -> (state, stats, ReplayControl for the updates until the next event).

    ``counts``: {net: (grow (L,), prune (L,), magnitude)} from ``expansion.Schedule.step``.
    """
    k_batch, k_loss = jax.random.split(key)
    batch = agent.sample_batch(state, buffer, k_batch, cfg.reset_batch)
    losses = agent.plastic_losses(state, batch, k_loss)
    params = agent.plastic_params(state)
    review_name = review_network(agent)
    out, fau = {}, jnp.ones((), jnp.float32)
    for name, (p_field, o_field) in agent.PLASTIC.items():
        loss, p = losses[name], params[name]
        grads = jax.grad(loss)(p)  # dense: masked-out weights are 0, their gradients are not
        acts = instrument.activations(lambda: loss(p), [name])[name]
        dormant = expansion.dormant_units(_net(agent, state, name), p, acts, cfg.redo_tau)
        grow, prune, magnitude = counts[name]
        new_p, new_opt, stats = expansion.update_topology(
            p, getattr(state, o_field), grads, grow, prune, magnitude, dormant
        )
        state = state.replace(**{p_field: new_p, o_field: new_opt})
        out.update({f"plasticity/{name}/{k}": v for k, v in stats.items()})
        if name == review_name and acts:
            fau = expansion.pooled_active_fraction(acts)
            out[f"plasticity/{name}/ne_active_fraction"] = fau
    control = expansion.ReplayControl()
    if cfg.ne_review:
        control = control._replace(review=expansion.review_probability(fau))
        out["plasticity/review_prob"] = control.review
    if auto_batch_on(cfg, agent):
        control = control._replace(half=fau < expansion.AUTO_BATCH_FAU)
        out["plasticity/half_batch"] = control.half.astype(jnp.float32)
    return state, out, control


def _mask_params(agent, state):
    """Zero every masked-out weight of the plastic networks (NE's sparse start)."""
    for name, (p_field, o_field) in agent.PLASTIC.items():
        state = state.replace(**{p_field: optim_lib.apply_mask(getattr(state, o_field), getattr(state, p_field))})
    return state


def metrics_step(agent, state, batch, init_params, key):
    """Plasticity metrics of every plastic (or measured) network for one seed on ``batch``, with TRAC's
    played scale where a network's optimizer is TRAC (``trac_scales``)."""
    out = metrics_lib.compute(measured_losses(agent, state, batch, key), measured_params(agent, state), init_params)
    return {**out, **trac_scales(agent, state)}


def trac_scales(agent, state) -> dict:
    """``plasticity/<net>/trac_scale``: the scale S_t = max(sum_beta s_beta, 0) TRAC plays for each network
    whose optimizer is TRAC (``plasticity.trac``; Muppidi et al. 2024, Algorithm 1); {} without TRAC."""
    out = {}
    for name, (_, o_field) in getattr(agent, "PLASTIC", {}).items():  # a MeasuredAgent (NeuBay) may have none
        tracked = trac_lib.find(getattr(state, o_field))
        if tracked is not None:
            out[f"plasticity/{name}/trac_scale"] = jnp.maximum(jnp.sum(tracked.s), 0.0)
    return out


@cached_per_config
def _reset_program(agent, cfg: PlasticityConfig):
    """ReDo / ReGraMa over the seed axis, jitted; cached so runs in one process share the program."""
    return jax.jit(jax.vmap(partial(reset_step, agent, cfg)), donate_argnums=(0,))


@cached_per_config
def _perturb_programs(agent, cfg: PlasticityConfig):
    """(Shrink & Perturb, layer reset) over the seed axis, jitted and cached like the resets."""
    return (
        jax.jit(jax.vmap(partial(shrink_perturb_step, agent, cfg)), donate_argnums=(0,)),
        jax.jit(jax.vmap(partial(layer_reset_step, agent, cfg)), donate_argnums=(0,)),
    )


@cached_per_config
def _injection_program(agent):
    """Plasticity injection over the seed axis, jitted and cached like the resets."""
    return jax.jit(jax.vmap(partial(injection_event, agent)), donate_argnums=(0,))


@cached_per_config
def _metrics_programs(agent, batch_size: int):
    """(metrics(state, batch, init_params, key), sample(state, buffer, key)) over the seed axis, jitted and cached."""
    return (
        jax.jit(jax.vmap(partial(metrics_step, agent))),
        jax.jit(jax.vmap(lambda s, b, k: agent.sample_batch(s, b, k, batch_size))),
    )


class Hooks:
    """Host-side scheduling of the plasticity events, for N vmapped seeds."""

    def __init__(self, cfg: PlasticityConfig, agent, agent_name: str, total_updates: int | None = None):
        check_applicable(cfg, agent, agent_name)
        self.cfg, self.agent = cfg, agent
        self.total_updates = total_updates
        self.schedule = None
        self.replay_control = None  # NE's per-seed ReplayControl for the loop's sampler (None: off)
        self.ne_traces = 0  # how often the NE event was traced (it must be once per run)
        self.resetting = cfg.redo or cfg.regrama
        self.metrics_batch = None
        self.init_params = None
        if self.resetting:
            self._reset = _reset_program(agent, cfg)
        if cfg.shrink_perturb or cfg.layer_reset:
            self._shrink_perturb, self._layer_reset = _perturb_programs(agent, cfg)
        # the update count after which plasticity injection happens (0: never)
        self.injection_update = cfg.injection_step or (
            max(1, round(cfg.injection_at * total_updates)) if cfg.injection_at and total_updates else 0
        )
        if cfg.injection_at and not total_updates:
            raise ValueError("--plasticity.injection-at needs the run's total number of updates")
        if self.injection_update:
            self._inject = _injection_program(agent)
        if cfg.metrics_every:
            self._metrics, self._sample = _metrics_programs(agent, cfg.metrics_batch)
        if cfg.ne:
            if not total_updates:
                raise ValueError("NE's growth schedule needs the run's total number of updates")

            def event(state, buffer, key, counts):
                self.ne_traces += 1
                return ne_step(agent, cfg, state, buffer, key, counts)

            self._ne = jax.jit(jax.vmap(event, in_axes=(0, 0, 0, None)), donate_argnums=(0,))

    def start(self, state):
        """Call once on the fresh state -> state (NE: masked-out weights zeroed, so the nets start sparse)."""
        cfg = self.cfg
        if cfg.ne:
            seeds = jax.tree.leaves(state)[0].shape[0]
            plans = {}
            for name, (p_field, o_field) in self.agent.PLASTIC.items():
                if optim_lib.find_masked(getattr(state, o_field)) is None:
                    raise ValueError(
                        f"--plasticity.ne: network {name!r} has no NE masks in its optimizer state "
                        "(the loop must build the agent with static_plasticity(...))"
                    )
                shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), getattr(state, p_field))
                plans[name] = expansion.plan(shapes, cfg.ne_initial_sparsity, cfg.ne_init_space)
            self.schedule = expansion.Schedule(
                plans, self.total_updates, cfg.ne_target_sparsity, cfg.ne_schedule, cfg.ne_prune
            )
            state = jax.jit(partial(_mask_params, self.agent))(state)
            if cfg.ne_review or auto_batch_on(cfg, self.agent):  # until the first event: neither
                self.replay_control = expansion.ReplayControl(
                    jnp.zeros(seeds, jnp.float32) if cfg.ne_review else None,
                    jnp.zeros(seeds, bool) if auto_batch_on(cfg, self.agent) else None,
                )
        if cfg.metrics_every:
            self.init_params = _copy(measured_params(self.agent, state))
        return state

    def after_updates(self, before: int, after: int, state, buffer, key):
        """Run the events due between update counts ``before`` and ``after`` -> (state, per-seed rows)."""
        rows = None
        if self.injection_update and before < self.injection_update <= after:
            state, out = self._inject(state, jax.random.split(jax.random.fold_in(key, 5), _seeds(state)))
            rows = _rows(out)
        every = self.cfg.reset_every
        if self.resetting and every and after // every > before // every:
            keys = jax.random.split(key, jax.tree.leaves(state)[0].shape[0])
            state, out = self._reset(state, buffer, keys)
            rows = _merge(rows, _rows(out))
        every = self.cfg.sp_every
        if self.cfg.shrink_perturb and after // every > before // every:
            state = self._shrink_perturb(state, jax.random.split(jax.random.fold_in(key, 3), _seeds(state)))
        every = self.cfg.layer_reset_every
        if self.cfg.layer_reset and after // every > before // every:
            state, out = self._layer_reset(state, jax.random.split(jax.random.fold_in(key, 4), _seeds(state)))
            rows = _merge(rows, _rows(out))
        every = self.cfg.metrics_every
        if every and after // every > before // every:
            n = jax.tree.leaves(state)[0].shape[0]
            k_batch, k_metrics = jax.random.split(jax.random.fold_in(key, 1))
            if self.metrics_batch is None:  # the fixed held-out batch, drawn once per run
                self.metrics_batch = self._sample(state, buffer, jax.random.split(k_batch, n))
            out = self._metrics(state, self.metrics_batch, self.init_params, jax.random.split(k_metrics, n))
            rows = _merge(rows, _rows(out))
        every = self.cfg.ne_every
        if self.cfg.ne and after // every > before // every:
            counts = self.schedule.step(after // every * every)
            keys = jax.random.split(jax.random.fold_in(key, 2), jax.tree.leaves(state)[0].shape[0])
            state, out, control = self._ne(state, buffer, keys, counts)
            if self.replay_control is not None:
                self.replay_control = control
            rows = _merge(rows, _rows(out))
        return state, rows

    def host_state(self):
        return {
            "metrics_batch": None if self.metrics_batch is None else jax.tree.map(np.asarray, self.metrics_batch),
            "ne": None if self.schedule is None else self.schedule.state_dict(),
            "review": None
            if self.replay_control is None or self.replay_control.review is None
            else np.asarray(self.replay_control.review),
            "half_batch": None
            if self.replay_control is None or self.replay_control.half is None
            else np.asarray(self.replay_control.half),
        }

    def restore(self, host):
        batch = host.get("metrics_batch")
        self.metrics_batch = None if batch is None else jax.tree.map(jnp.asarray, batch)
        if self.schedule is not None and host.get("ne") is not None:
            self.schedule.load_state_dict(host["ne"])
        c = self.replay_control
        if c is not None:
            if c.review is not None and host.get("review") is not None:
                c = c._replace(review=jnp.asarray(host["review"], jnp.float32))
            if c.half is not None and host.get("half_batch") is not None:
                c = c._replace(half=jnp.asarray(host["half_batch"], bool))
            self.replay_control = c


def _seeds(state) -> int:
    return jax.tree.leaves(state)[0].shape[0]


def _rows(out: dict) -> list[dict]:
    out = {k: np.asarray(v) for k, v in out.items()}
    n = len(next(iter(out.values())))
    return [{k: float(v[j]) for k, v in out.items()} for j in range(n)]


def _merge(a, b):
    if a is None:
        return b
    return [{**x, **y} for x, y in zip(a, b)]


def regularizer_spec(cfg: PlasticityConfig) -> optim_lib.RegSpec | None:
    """L2 / L2 Init / Parseval / NaP for the plastic networks' optimizers (None: all off)."""
    spec = optim_lib.RegSpec(cfg.l2, cfg.l2_init, cfg.parseval, cfg.parseval_scale, cfg.nap)
    return spec if spec.adds_gradient or spec.nap else None


def check_regularizers(cfg: PlasticityConfig, agent, agent_name: str, state):
    """Refuse the regulariser flags on an agent without plastic networks or whose plastic networks'
    optimizers ignored them, and NaP on a plastic network without LayerNorm."""
    reg = regularizer_spec(cfg)
    flags = ", ".join(
        f
        for f, on in (
            ("--plasticity.l2", cfg.l2 > 0),
            ("--plasticity.l2-init", cfg.l2_init > 0),
            ("--plasticity.parseval", cfg.parseval > 0),
            ("--plasticity.nap", cfg.nap),
        )
        if on
    )
    if not isinstance(agent, PlasticAgent):
        why = (
            getattr(agent, "INTERVENTIONS_REFUSED", None)
            or "it declares no plastic networks (plasticity.api.PlasticAgent)"
        )
        raise ValueError(f"{flags} does not apply to agent {agent_name!r}: {why}")
    kinds = [
        k
        for k, on in ((optim_lib.regularizers.RegState, reg.adds_gradient), (optim_lib.regularizers.NaPState, reg.nap))
        if on
    ]
    missing = sorted(
        name
        for name, (_, o_field) in agent.PLASTIC.items()
        if any(optim_lib.regularizers.find(getattr(state, o_field), k) is None for k in kinds)
    )
    if missing:
        raise ValueError(
            f"{flags} does not apply to agent {agent_name!r}: the optimizers of {', '.join(missing)} "
            "are not built with plasticity.optim.optimizer"
        )
    if reg.nap:
        bare = sorted(
            name
            for name, (p_field, _) in agent.PLASTIC.items()
            if not any(
                optim_lib.path_names(p)[-1:] == ("scale",)
                for p, _ in jax.tree_util.tree_flatten_with_path(getattr(state, p_field))[0]
            )
        )
        if bare:
            raise ValueError(
                f"--plasticity.nap needs a LayerNorm before each nonlinearity, and the networks "
                f"{', '.join(bare)} of agent {agent_name!r} have none: add --network.layer-norm"
            )

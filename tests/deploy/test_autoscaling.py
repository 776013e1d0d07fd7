"""The MoerayServer autoscaling policy (router_service.autoscaling): the rule on a synthetic load trace in
simulated time, agreement with Ray Serve's own delay wrapper, the Serve config's wiring, and (Ray) a tiny
deployment scaled by the real policy under a load trace from threads."""
from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import yaml

from router_service.autoscaling import (BALANCEDNESS, IN_FLIGHT, ITL_P95_MS, MoerayAutoscalingPolicy, PolicyConfig,
                                        ReplicaSignals, Signals, desired_replicas, itl_p95_ms, rank_balancedness,
                                        signals_from_context, step)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVE_CONFIG = os.path.join(REPO, "deploy", "serve_config.yaml")
POLICY_PATH = "router_service.autoscaling:MoerayAutoscalingPolicy"

# ---------------------------------------------------------------------------------------------- the trace
TICK_S = 1.0
STARTUP_S = 20.0      # a new EP cluster takes this long to come up (placement group + weights)
MAX_QUEUE = 256       # router queue limit per replica (deploy/serve_config.yaml args.max_queue)
CFG = PolicyConfig(min_replicas=1, max_replicas=4, target_queue_depth=64, itl_target_ms=100.0,
                   downscale_itl_fraction=0.7, upscale_delay_s=30.0, downscale_delay_s=600.0)


def offered(t: float) -> float:
    """Concurrent requests offered at time t (s): rising 10 -> 400 over 180 s, steady 300 s, falling to 10
    over 60 s, then 10 until the end."""
    if t < 180:
        return 10 + 390 * t / 180
    if t < 480:
        return 400.0
    if t < 540:
        return 400 - 390 * (t - 480) / 60
    return 10.0


RISE_END, STEADY_END, FALL_END, END = 180.0, 480.0, 540.0, 1500.0


def signals_at(t: float, running: int) -> Signals:
    """What the replicas would report: the load spread over the running replicas; each replica's decode step
    grows with its batch (ITL = 20 ms + 0.35 ms per request in flight); ranks at balancedness 0.8."""
    per_replica = offered(t) / running
    return Signals(queue_depth=offered(t), itl_p95_ms=20.0 + 0.35 * per_replica, balancedness=0.8)


def simulate(decide):
    """Run the trace. `decide(t, sig, running, target) -> target'` is one tick of a policy. New replicas
    start STARTUP_S after the target rises; removed ones stop at once (Serve drains them). Returns per-tick
    rows (t, desired undelayed, target, running, dropped requests)."""
    target, running, starting = 1, 1, []  # `starting`: times at which pending replicas come up
    rows = []
    t = 0.0
    while t <= END:
        while starting and starting[0] <= t:
            starting.pop(0)
            running += 1
        sig = signals_at(t, running)
        new = decide(t, sig, running, target)
        if new > target:
            starting += [t + STARTUP_S] * (new - target)
        elif new < target:
            drop = target - new
            cancel = min(drop, len(starting))
            starting = starting[:len(starting) - cancel]
            running -= drop - cancel
        target = new
        dropped = max(0.0, offered(t) - running * MAX_QUEUE)
        rows.append((t, desired_replicas(sig, running, CFG), target, running, dropped))
        t += TICK_S
    return rows


def test_desired_replicas_rule():
    # by queue: 200 requests / (64 * 0.8) = 3.9 -> 4
    assert desired_replicas(Signals(queue_depth=200, balancedness=0.8), 2, CFG) == 4
    # exactly full is not one more (float slack)
    assert desired_replicas(Signals(queue_depth=128.0000000001), 1, CFG) == 2
    # by latency: 150 ms over a 100 ms target with 2 replicas -> 3
    assert desired_replicas(Signals(queue_depth=10, itl_p95_ms=150), 2, CFG) == 3
    # near the target (80 ms > 0.7 * 100): no downscale even with a short queue
    assert desired_replicas(Signals(queue_depth=10, itl_p95_ms=80), 3, CFG) == 3
    assert desired_replicas(Signals(queue_depth=10, itl_p95_ms=60), 3, CFG) == 1
    # bounds
    assert desired_replicas(Signals(queue_depth=10_000), 1, CFG) == CFG.max_replicas
    assert desired_replicas(Signals(queue_depth=0), 3, CFG) == CFG.min_replicas


def test_config_and_signal_errors_name_the_field():
    with pytest.raises(ValueError, match="max_replicas=0"):
        PolicyConfig(min_replicas=1, max_replicas=0)
    with pytest.raises(ValueError, match="itl_target_ms=0"):
        PolicyConfig(itl_target_ms=0)
    with pytest.raises(ValueError, match="balancedness=1.5"):
        Signals(queue_depth=1, balancedness=1.5)
    with pytest.raises(ValueError, match="downscale_itl_fraction=2"):
        MoerayAutoscalingPolicy(downscale_itl_fraction=2)


def test_policy_on_a_rising_steady_falling_trace():
    state: dict = {}

    def decide(t, sig, running, target):
        nonlocal state
        new, state = step(sig, running, target, t, state, CFG)
        return new

    rows = simulate(decide)
    targets = [r[2] for r in rows]
    assert all(CFG.min_replicas <= n <= CFG.max_replicas for n in targets)
    assert sum(r[4] for r in rows) == 0, "requests over the router queue limit of the running replicas"

    # every change comes exactly one delay after its direction started, never earlier, never later
    streak_start, streak_dir, prev = None, 0, 1
    changes = []
    for t, want, target, _, _ in rows:
        d = (want > prev) - (want < prev)
        if d != streak_dir:
            streak_start, streak_dir = t, d
        if target != prev:
            delay = CFG.upscale_delay_s if target > prev else CFG.downscale_delay_s
            assert delay <= t - streak_start + 1e-6 <= delay + TICK_S, (t, prev, target, streak_start)
            changes.append((t, prev, target))
            streak_start, streak_dir = t, 0
        prev = target
    ups = [c for c in changes if c[2] > c[1]]
    downs = [c for c in changes if c[2] < c[1]]
    assert ups and downs
    # up while load rises, down only after it fell; nothing moves in the steady phase once settled
    assert all(t <= STEADY_END for t, _, _ in ups) and all(t >= FALL_END for t, _, _ in downs)
    assert max(targets) == CFG.max_replicas
    settled = [r[2] for r in rows if RISE_END + CFG.upscale_delay_s + STARTUP_S <= r[0] < STEADY_END]
    assert set(settled) == {CFG.max_replicas}
    # back to the minimum, and not before the downscale delay after the fall began
    assert targets[-1] == CFG.min_replicas
    assert min(t for t, _, _ in downs) >= STEADY_END + CFG.downscale_delay_s


class _Clock:
    """Stands in for the `time` module inside ray.serve.autoscaling_policy (simulated seconds)."""

    def __init__(self):
        self.now = 0.0

    def time(self) -> float:
        return self.now


def _context(t, sig: Signals, running: int, target: int, state: dict, config, reported: bool = True):
    """An AutoscalingContext as Serve's controller builds it, with per-replica custom metrics that add up to
    `sig` (in flight split evenly; every replica at the same ITL and balancedness), or none if not `reported`."""
    from ray.serve.config import AutoscalingContext

    ids = [f"replica-{i}" for i in range(running)]
    metrics = {IN_FLIGHT: {r: sig.queue_depth / running for r in ids},
               ITL_P95_MS: {r: sig.itl_p95_ms for r in ids},
               BALANCEDNESS: {r: sig.balancedness for r in ids}} if reported else {}
    return AutoscalingContext(
        deployment_id=None, deployment_name="MoerayServer", app_name="moeray", current_num_replicas=running,
        target_num_replicas=target, running_replicas=ids, total_num_requests=sig.queue_depth,
        total_queued_requests=0.0, aggregated_metrics=metrics, raw_metrics={},
        capacity_adjusted_min_replicas=config.min_replicas, capacity_adjusted_max_replicas=config.max_replicas,
        policy_state=dict(state), last_scale_up_time=None, last_scale_down_time=None, current_time=t,
        config=config)


def test_serve_wrapped_policy_matches_step_tick_for_tick(monkeypatch):
    """Serve (2.60) wraps every custom policy in its delay and bounds logic; the hook returns the undelayed
    count, so Serve's wrapper around it must give what `step` gives on the same trace."""
    aps = pytest.importorskip("ray.serve.autoscaling_policy")
    if not hasattr(aps, "_apply_autoscaling_config"):
        pytest.skip("this Ray has no _apply_autoscaling_config (the wrapping moved)")
    from ray.serve.config import AutoscalingConfig

    config = AutoscalingConfig(min_replicas=CFG.min_replicas, max_replicas=CFG.max_replicas,
                               target_ongoing_requests=CFG.target_queue_depth, upscale_delay_s=CFG.upscale_delay_s,
                               downscale_delay_s=CFG.downscale_delay_s,
                               policy={"policy_function": POLICY_PATH,
                                       "policy_kwargs": {"itl_target_ms": CFG.itl_target_ms,
                                                         "downscale_itl_fraction": CFG.downscale_itl_fraction}})
    policy = MoerayAutoscalingPolicy(**config.policy.policy_kwargs)
    wrapped = aps._apply_autoscaling_config(policy)
    clock = _Clock()
    monkeypatch.setattr(aps, "time", clock)
    serve_state: dict = {}

    def by_serve(t, sig, running, target):
        nonlocal serve_state
        clock.now = t
        n, serve_state = wrapped(_context(t, sig, running, target, serve_state, config))
        return max(config.min_replicas, min(config.max_replicas, n))  # the controller's apply_bounds

    ours: dict = {}

    def by_step(t, sig, running, target):
        nonlocal ours
        n, ours = step(sig, running, target, t, ours, CFG)
        return n

    assert [r[2] for r in simulate(by_serve)] == [r[2] for r in simulate(by_step)]
    assert serve_state["moeray"]["desired"] == 1


def test_signals_from_context_falls_back_to_serve_counts():
    from ray.serve.config import AutoscalingConfig

    config = AutoscalingConfig(min_replicas=1, max_replicas=4, target_ongoing_requests=64)
    ctx = _context(0.0, Signals(queue_depth=100, itl_p95_ms=30, balancedness=0.5), 2, 2, {}, config)
    assert signals_from_context(ctx) == Signals(queue_depth=100, itl_p95_ms=30, balancedness=0.5)
    # replicas not reporting yet: Serve's own request count
    ctx = _context(0.0, Signals(queue_depth=100, itl_p95_ms=30), 2, 2, {}, config, reported=False)
    assert signals_from_context(ctx) == Signals(queue_depth=100)
    policy = MoerayAutoscalingPolicy(itl_target_ms=100)
    n, state = policy(ctx)
    assert n == 2 and state["moeray"]["queue_depth"] == 100


def test_replica_side_signals():
    # two streams; the second emits a 2-token chunk after 40 ms: two gaps of 20 ms
    now = 100.0
    streams = [(90.0, [9.0, 9.01, 9.02, 9.03]), (95.0, [4.90, 4.94, 4.94])]
    p95 = itl_p95_ms(streams, now, window_s=10.0)
    assert p95 == pytest.approx(20.0)
    assert itl_p95_ms(streams, now, window_s=0.01) == 0.0
    assert itl_p95_ms([], now, 10.0) == 0.0
    assert rank_balancedness([[10, 10], [30, 10]]) == pytest.approx((10 + 20) / (10 + 30))
    assert rank_balancedness([]) == 1.0

    class Out:
        def __init__(self, times):
            self.token_times = times

    class Stream:
        def __init__(self, t0, times):
            self.t0, self.out = t0, Out(times)

    class FakeRouter:
        def __init__(self):
            self._streams = {"a": Stream(time.perf_counter() - 1.0, [0.5, 0.55, 0.6])}
            self.load = [[100, 100], [100, 100]]

        def streams(self):
            return list(self._streams.values())

        def stats(self):
            return {"rank_load": [list(r) for r in self.load]}

    r = FakeRouter()
    sig = ReplicaSignals(window_s=10.0)
    m = sig.collect(r)
    assert m[IN_FLIGHT] == 1.0 and m[ITL_P95_MS] == pytest.approx(50.0) and m[BALANCEDNESS] == 1.0
    r.load = [[130, 110], [100, 100]]  # this interval: layer 0 (30, 10), layer 1 idle
    assert sig.collect(r)[BALANCEDNESS] == pytest.approx(20 / 30)
    assert sig.collect(r)[BALANCEDNESS] == pytest.approx(20 / 30)  # idle interval keeps the last value
    assert all(isinstance(v, float) for v in m.values())


# ---------------------------------------------------------------------------------------------- the config
def _autoscaling_configs() -> list[dict]:
    with open(SERVE_CONFIG) as f:
        cfg = yaml.safe_load(f)
    return [d["autoscaling_config"] for app in cfg["applications"] for d in app["deployments"]]


def test_serve_config_wires_the_policy():
    from ray.serve._private.utils import import_attr
    from ray.serve.config import AutoscalingConfig

    (ac,) = _autoscaling_configs()
    config = AutoscalingConfig(**ac)
    assert config.policy.policy_function == POLICY_PATH
    assert import_attr(POLICY_PATH) is MoerayAutoscalingPolicy
    # what the controller runs: the cloudpickled definition, built once with policy_kwargs
    built = config.policy.get_policy()(**config.policy.policy_kwargs)
    assert callable(built) and built.itl_target_ms == ac["policy"]["policy_kwargs"]["itl_target_ms"]
    ctx = _context(0.0, Signals(queue_depth=0), 1, 1, {}, config)
    n, state = built(ctx)
    assert n == config.min_replicas and isinstance(state, dict)


# ---------------------------------------------------------------------------------------------- Serve, for real
try:
    from ray import serve
except ImportError:  # pragma: no cover
    serve = None

if serve is not None:

    @serve.deployment(name="ScaledEcho", max_ongoing_requests=8, ray_actor_options={"num_cpus": 0},
                      graceful_shutdown_timeout_s=20)
    class ScaledEcho:
        """A stand-in for MoerayServer: each request takes 0.3 s; the replica reports the policy's three
        signals (ITL grows 25 ms per request in flight, like a decode step with the batch)."""

        def __init__(self):
            self.ongoing = 0

        async def __call__(self, i: int) -> int:
            self.ongoing += 1
            try:
                await asyncio.sleep(0.3)
                return i
            finally:
                self.ongoing -= 1

        def record_autoscaling_stats(self) -> dict[str, float]:
            return {IN_FLIGHT: float(self.ongoing), ITL_P95_MS: 25.0 * self.ongoing, BALANCEDNESS: 1.0}


def _running(app: str, name: str) -> int:
    d = serve.status().applications[app].deployments[name]
    return d.replica_states.get("RUNNING", 0)


@pytest.mark.ray
def test_serve_scales_a_deployment_up_and_down_without_dropping_requests(ray_session):
    """Only the latency signal can scale here: target_ongoing_requests is far above the load (Serve's default
    policy would stay at 1 replica), while the replicas' ITL p95 passes the shipped 100 ms target at 5
    requests in flight per replica."""
    (ac,) = _autoscaling_configs()
    assert ac["policy"]["policy_kwargs"]["itl_target_ms"] == 100
    autoscaling = {"min_replicas": 1, "initial_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 100,
                   "upscale_delay_s": 2, "downscale_delay_s": 5, "metrics_interval_s": 0.5,
                   "look_back_period_s": 2, "policy": ac["policy"]}  # the shipped policy and its kwargs
    app = "autoscaling-test"
    serve.start(proxy_location="Disabled")
    handle = serve.run(ScaledEcho.options(autoscaling_config=autoscaling).bind(), name=app, route_prefix=None)
    # first call from this thread: client threads racing to build the handle's router would each build one,
    # and the extra ones' metrics pushers outlive the test (calling Ray after ray.shutdown())
    assert handle.remote(0).result(timeout_s=60) == 0
    sent, done, errors = [0], [], []
    lock = threading.Lock()
    active = []  # one stop flag per client thread

    def client(stop: threading.Event):
        while not stop.is_set():
            with lock:
                sent[0] += 1
                i = sent[0]
            try:
                r = handle.remote(i).result(timeout_s=60)
                with lock:
                    done.append(r == i)
            except Exception as e:  # noqa: BLE001 - a dropped request is a test failure, reported below
                with lock:
                    errors.append(repr(e))

    def clients(n: int):
        while len(active) < n:
            ev = threading.Event()
            threading.Thread(target=client, args=(ev,), daemon=True).start()
            active.append(ev)
        while len(active) > n:
            active.pop().set()

    def wait_for(pred, timeout_s: float) -> list[int]:
        seen, t_end = [], time.monotonic() + timeout_s
        while time.monotonic() < t_end:
            seen.append(_running(app, "ScaledEcho"))
            if pred(seen[-1]):
                break
            time.sleep(0.5)
        return seen

    try:
        for n in (2, 5, 8, 12):  # rising
            clients(n)
            time.sleep(1.0)
        up = wait_for(lambda r: r >= 3, 60)  # 12 clients: ITL 200 ms at 1 replica, 150 at 2 -> 3 (the max)
        steady = wait_for(lambda r: False, 3)
        clients(1)  # falling: ITL 25 ms, under 0.7 x target
        down = wait_for(lambda r: r == 1, 60)
        clients(0)
        t_end = time.monotonic() + 30
        while time.monotonic() < t_end and len(done) + len(errors) < sent[0]:
            time.sleep(0.1)
    finally:
        clients(0)
        serve.delete(app)
        serve.shutdown()
        # last (a config update from the controller restarts it): stop the handle's metrics pusher, which
        # would otherwise call Ray after ray.shutdown() and start a new Ray instance at exit
        handle.shutdown()
    assert up[-1] >= 3 and min(steady) >= 3, (up, steady)
    assert down[-1] == 1, down
    assert not errors, errors[:3]
    assert len(done) == sent[0] and all(done), f"{len(done)} of {sent[0]} requests completed"
    assert len(done) > 50


@pytest.mark.ray
def test_replica_signals_of_a_real_router(ray_session, tiny_model_dir):
    """What MoerayServer.record_autoscaling_stats reports, on a 2-rank tiny cluster mid-generation."""
    from actors.engine.sampling import SamplingParams
    from tests.router_service.conftest import start_llm, wait_idle

    llm = start_llm(tiny_model_dir("qwen2_moe"), ranks=2)
    try:
        sig = ReplicaSignals(window_s=30.0)
        params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
        streams = [llm.router.submit(p, params) for p in ("To be, or not to be", "def add(a, b):", "The quick")]
        deadline = time.monotonic() + 60
        while min(len(s.out.token_times) for s in streams) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        mid = sig.collect(llm.router)
        outs = [s.result(timeout=120) for s in streams]
        wait_idle(llm.router)
        after = sig.collect(llm.router)
    finally:
        llm.shutdown()
    assert all(o.finish_reason == "length" for o in outs)
    assert mid[IN_FLIGHT] == 3.0 and mid[ITL_P95_MS] > 0 and 0 < mid[BALANCEDNESS] <= 1
    assert after[IN_FLIGHT] == 0.0 and after[ITL_P95_MS] == 0.0 and 0 < after[BALANCEDNESS] <= 1

"""Ray executor: one Ray actor per rank, placed by a placement group on any node of a Ray
cluster (multi-node tensor and pipeline parallelism).

Start-up: connect to the cluster (RAY_ADDRESS, a `ray start --head` cluster on this machine,
or the Ray already initialised in this process; else a local one is started), check the
cluster has a CPU (CPU platform) or GPU (CUDA) per rank, reserve one bundle per rank in a
placement group (STRICT_PACK when one node holds the whole world, else PACK), and start the
actors. Ranks are given to bundles node by node, so a tensor-parallel group (consecutive
ranks) shares a node where the nodes allow. Rank 0's node address and a free port there are
torch.distributed's rendezvous (gloo on the CPU, nccl on CUDA); the workers then build the
tensor- and pipeline-parallel groups as in the mp executor.

Every call goes to all actors and waits for each; a dead actor (killed, node lost) raises
EngineFatalError naming its rank and node at once, without waiting for ranks blocked in a
collective with it. Between calls every actor runs a second, idle method (`watch`) that only
returns when the actor dies: a monitor thread waiting on those answers learns of a death at
once (`start_health_monitor`). Shutdown stops the actors and removes the placement group (and
the local cluster if this executor started it).
"""
from __future__ import annotations

import os
import threading
import time
import traceback
import uuid
from typing import TYPE_CHECKING, Any

from vllm.engine.errors import EngineFatalError
from vllm.engine.executor import (
    _SERVING_METHODS,
    WORKER_REPLY_TIMEOUT_S,
    UniProcExecutor,
    _WorkerWatch,
)
from vllm.engine.worker import output_rank
from vllm.logger import init_logger
from vllm.utils.cpu_threads import RAY_SHARE_ENV

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.engine.sched_output import ModelRunnerOutput, SchedulerOutput

logger = init_logger(__name__)

_ENV_PREFIXES = ("VLLM_", "HF_", "TRANSFORMERS_", "TORCHINDUCTOR_", "TORCH_", "HUGGING")
"""Environment variables the actors get from this process (Ray workers do not inherit it)."""


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ImportError("distributed_executor_backend='ray' needs Ray: pip install "
                          "'vllm[ray]' (or pip install 'ray[default]')") from None
    return ray


class RayWorker:
    """The actor of one rank: holds a Worker and runs its methods as the executor asks."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        self.worker = None
        self._stop = threading.Event()

    def node_info(self) -> tuple[str, str, int, int]:
        """(node id, node IP, a free port on this node, this actor's pid)."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return (ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), port,
                os.getpid())

    def init_worker(self, rank: int, local_rank: int, init_method: str) -> None:
        from vllm.engine.worker import Worker
        from vllm.logger import set_process_prefix

        set_process_prefix(f"(Ray rank={rank} pid={os.getpid()}) ")
        self.worker = Worker(self.vllm_config, rank=rank, local_rank=local_rank,
                             distributed_init_method=init_method)
        self.rank = rank

    def execute_method(self, method: str, *args: Any) -> Any:
        result = getattr(self.worker, method)(*args)
        if method == "execute_model" and self.rank != output_rank(self.vllm_config):
            return None  # only the output rank's answer is read
        return result

    def kv_info(self) -> tuple[int, str]:
        return self.worker.block_bytes, self.worker.kv_source

    def take_startup_events(self) -> list:
        from vllm.utils.startup_timer import get_startup_timer

        return get_startup_timer().take_events()

    def watch(self) -> None:
        """Returns when the executor stops: until then an answer means the actor died."""
        self._stop.wait()

    def stop(self) -> None:
        self._stop.set()
        if self.worker is not None:
            try:
                self.worker.shutdown()
            except Exception:  # noqa: BLE001 - stopping anyway
                logger.debug("worker shutdown failed", exc_info=True)


class RayExecutor(UniProcExecutor):
    """One Ray actor per rank; this process only schedules and coordinates."""

    def __init__(self, vllm_config: VllmConfig, load_format: str = "auto") -> None:
        ray = import_ray()
        self.vllm_config = vllm_config
        self.world = vllm_config.parallel_config.world_size
        self._output_rank = output_rank(vllm_config)
        self._ray = ray
        self._owns_ray = False
        self._pg = None
        self._actors: list[Any] = []
        self._nodes: list[str] = []
        self._watch = _RayWatch(self)
        self._tag = uuid.uuid4().hex[:8]
        self.worker = None
        try:
            self._connect()
            self._place()
            self._start_actors()
            self._start(load_format)
        except BaseException:
            self.shutdown()
            raise
        self._watch.start()

    # ---- start-up ---------------------------------------------------------------------
    def _connect(self) -> None:
        ray = self._ray
        if ray.is_initialized():
            return
        address = os.environ.get("RAY_ADDRESS")
        ray.init(address=address, log_to_driver=True, logging_level="warning")
        self._owns_ray = address is None and not _joined_existing_cluster(ray)
        logger.info("Ray: %s cluster at %s", "started a local" if self._owns_ray else "joined a",
                    ray.get_runtime_context().gcs_address)

    def _resource(self) -> str:
        return "GPU" if self.vllm_config.platform.is_cuda() else "CPU"

    def _place(self) -> None:
        ray = self._ray
        from ray.util.placement_group import placement_group

        key = self._resource()
        total = int(ray.cluster_resources().get(key, 0))
        per_node = [int(n["Resources"].get(key, 0)) for n in ray.nodes() if n.get("Alive")]
        if self.world > total:
            raise ValueError(
                f"world_size {self.world} (tensor_parallel_size="
                f"{self.vllm_config.parallel_config.tensor_parallel_size} x "
                f"pipeline_parallel_size={self.vllm_config.parallel_config.pipeline_parallel_size}"
                f") needs one {key} per rank; the Ray cluster has {total} {key}s "
                f"({len(per_node)} nodes: {per_node}). Add nodes (ray start --address=...) or "
                "lower the parallel sizes.")
        strategy = "STRICT_PACK" if max(per_node, default=0) >= self.world else "PACK"
        self._pg = placement_group([{key: 1.0}] * self.world, strategy=strategy)
        from vllm import envs

        timeout = envs.VLLM_RAY_PLACEMENT_TIMEOUT_S
        ready, _ = ray.wait([self._pg.ready()], timeout=timeout)
        if not ready:
            raise RuntimeError(
                f"the Ray placement group of {self.world} {key} bundles ({strategy}) was not "
                f"placed within {timeout:.0f} s (VLLM_RAY_PLACEMENT_TIMEOUT_S); free "
                f"{key}s per node: {per_node}. Other jobs may hold them.")
        logger.info("Ray placement group: %d %s bundles (%s)", self.world, key, strategy)

    def _start_actors(self) -> None:
        ray = self._ray
        from ray.util.placement_group import placement_group_table
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        table = placement_group_table(self._pg)
        bundle_nodes = table.get("bundles_to_node_id", {})
        # Ranks node by node (stable in bundle order within a node): consecutive ranks, a
        # tensor-parallel group, share a node where the nodes allow.
        first_seen: dict[str, int] = {}
        for i in range(self.world):
            first_seen.setdefault(bundle_nodes.get(i, ""), i)
        bundles = sorted(range(self.world),
                         key=lambda i: (first_seen[bundle_nodes.get(i, "")], i))
        resource = ({"num_gpus": 1, "num_cpus": 0} if self._resource() == "GPU"
                    else {"num_cpus": 1})
        actor_cls = ray.remote(max_concurrency=2, **resource)(RayWorker)
        env = actor_env()
        threads = self._cpu_threads(bundle_nodes)
        node_ranks = [bundle_nodes.get(b, "") for b in bundles]
        for rank, bundle in enumerate(bundles):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=bundle,
                placement_group_capture_child_tasks=True)
            env_vars = dict(env)
            if threads and "OMP_NUM_THREADS" not in os.environ:
                node = node_ranks[rank]
                # Ray would give a 1-CPU actor OMP_NUM_THREADS=1; the worker plans from its
                # host's cores shared by the ranks on the node, capped by this share.
                env_vars["OMP_NUM_THREADS"] = str(threads[node])
                env_vars[RAY_SHARE_ENV] = (f"{threads[node]}:{node_ranks.count(node)}:"
                                           f"{node_ranks[:rank].count(node)}")
            self._actors.append(actor_cls.options(
                scheduling_strategy=strategy, name=f"vllm-{self._tag}-rank{rank}",
                runtime_env={"env_vars": env_vars}).remote(self.vllm_config))
        infos = self._get_all([a.node_info.remote() for a in self._actors], "start-up")
        self._nodes = [f"{ip} ({node_id[:8]})" for node_id, ip, _, _ in infos]
        self._pids = [pid for _, _, _, pid in infos]
        _, ip0, port0, _ = infos[0]
        init_method = f"tcp://{ip0}:{port0}"
        # Ray gives each GPU actor its own CUDA_VISIBLE_DEVICES: its device is cuda:0.
        self._get_all([a.init_worker.remote(rank, 0, init_method)
                       for rank, a in enumerate(self._actors)], "start-up")
        self._watch_refs = [a.watch.remote() for a in self._actors]
        logger.info("Ray workers: %s", ", ".join(
            f"rank {r} on {n} (pid {p})" for r, (n, p) in enumerate(zip(self._nodes,
                                                                         self._pids))))

    def _cpu_threads(self, bundle_nodes: dict) -> dict[str, int]:
        """CPU platform: intra-op threads per rank on each node, its CPUs shared by the ranks
        placed there (Ray would give each 1-CPU actor OMP_NUM_THREADS=1). {} on CUDA."""
        if self._resource() != "CPU":
            return {}
        cpus = {n["NodeID"]: int(n["Resources"].get("CPU", 1)) for n in self._ray.nodes()
                if n.get("Alive")}
        ranks: dict[str, int] = {}
        for node in bundle_nodes.values():
            ranks[node] = ranks.get(node, 0) + 1
        return {node: max(1, cpus.get(node, 1) // count) for node, count in ranks.items()} | \
            {"": 1}

    def _kv_info(self) -> tuple[int, str]:
        return self._ray.get(self._actors[0].kv_info.remote())

    def _worker_startup_events(self) -> list:
        """Rank 0's actor records its compiles, kernel builds and captures in its own process:
        they become rows of the engine's start-up table (not "warm-up")."""
        return self._get_all([self._actors[0].take_startup_events.remote()], "start-up")[0]

    # ---- calls ------------------------------------------------------------------------
    def _node(self, rank: int) -> str:
        return self._nodes[rank] if rank < len(self._nodes) else "node unknown"

    def _death(self, rank: int, when: str, exc: BaseException | None = None) -> EngineFatalError:
        cause = ""
        if exc is not None:
            lines = [line for line in str(exc).splitlines() if line.strip()]
            cause = f": {lines[0][:300]}" if lines else f": {type(exc).__name__}"
        return EngineFatalError(f"Ray worker rank {rank} on node {self._node(rank)} died "
                                f"{when}{cause}")

    def _get_all(self, refs: list[Any], method: str,
                 serving: bool = False) -> list[Any]:
        """Every rank's answer, in rank order. A dead actor: EngineFatalError at once. A rank
        whose method raised: the others are still waited for (for at most
        WORKER_REPLY_TIMEOUT_S, then the engine is dead) and the error raised."""
        ray = self._ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        dead = (RayActorError, ActorDiedError, ActorUnavailableError)
        index = {ref: rank for rank, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        errors: list[str] = []
        pending = list(refs)
        deadline = None
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            # All at once (one wait per step), but back within a second to look for deaths.
            ready, pending = ray.wait(pending, num_returns=len(pending),
                                      timeout=1.0 if timeout is None else min(timeout, 1.0))
            if self._watch.error is not None:
                raise self._watch.error
            for ref in ready:
                rank = index[ref]
                try:
                    results[rank] = ray.get(ref)
                except dead as exc:
                    raise self._watch.report(self._death(rank, f"during {method}", exc)) \
                        from None
                except Exception as exc:  # noqa: BLE001 - the rank's own failure
                    cause = getattr(exc, "cause", None) or exc
                    text = "".join(traceback.format_exception(cause)) if cause is not exc \
                        else str(exc)
                    errors.append(f"Ray worker rank {rank} on node {self._node(rank)} failed in "
                                  f"{method}:\n{text}")
                    if not serving:
                        raise RuntimeError(errors[-1]) from None
                    if deadline is None:
                        deadline = time.monotonic() + WORKER_REPLY_TIMEOUT_S
            if pending and deadline is not None and time.monotonic() > deadline:
                rank = index[pending[0]]
                raise self._watch.report(EngineFatalError(
                    f"Ray worker rank {rank} on node {self._node(rank)} did not answer "
                    f"{method} within {WORKER_REPLY_TIMEOUT_S:.0f} s after another rank failed "
                    "it: it is presumably stuck in a collective"))
        if errors:
            raise RuntimeError("\n".join(errors))
        return results

    def _call_all(self, method: str, *args: Any) -> list[Any]:
        if self._watch.error is not None:
            raise EngineFatalError(str(self._watch.error))
        refs = [a.execute_method.remote(method, *args) for a in self._actors]
        return self._get_all(refs, method, serving=method in _SERVING_METHODS)

    @property
    def model(self):
        raise AttributeError("the model lives in the Ray actors (distributed_executor_backend="
                             "'ray')")

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._call_all("execute_model", scheduler_output)[self._output_rank]

    def start_health_monitor(self, on_dead) -> None:
        self._watch.add_callback(on_dead)

    def shutdown(self) -> None:
        ray = self._ray
        if getattr(self, "_shut_down", False):
            return
        self._shut_down = True
        self._watch.stop()
        if self._actors and ray.is_initialized():
            stops = [a.stop.remote() for a in self._actors]
            patience = 10.0 if self._watch.error is None else 1.0
            ray.wait(stops, num_returns=len(stops), timeout=patience)
            for actor in self._actors:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # noqa: BLE001 - already gone
                    pass
        self._actors = []
        if self._pg is not None and ray.is_initialized():
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self._pg)
            except Exception:  # noqa: BLE001 - the cluster is gone
                logger.debug("removing the placement group failed", exc_info=True)
            self._pg = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()


class _RayWatch(_WorkerWatch):
    """Waits on every actor's `watch` call: one that answers (with the actor's death) while
    the executor runs is the engine's death."""

    def __init__(self, executor: RayExecutor) -> None:
        super().__init__([])
        self.executor = executor

    def stop(self) -> None:
        self.stopping.set()

    def _run(self) -> None:
        ex = self.executor
        ray = ex._ray
        refs = list(ex._watch_refs)
        index = {ref: rank for rank, ref in enumerate(refs)}
        while not self.stopping.is_set():
            try:
                ready, _ = ray.wait(refs, num_returns=1, timeout=0.5)
            except Exception:  # noqa: BLE001 - Ray itself is going away
                return
            if self.stopping.is_set():
                return
            if ready:
                rank = index[ready[0]]
                try:
                    ray.get(ready[0])
                    exc = None
                except Exception as e:  # noqa: BLE001 - the death's description
                    exc = e
                self.report(ex._death(rank, "while the engine was idle", exc))
                return


def actor_env() -> dict[str, str]:
    """The actors' environment variables: this process's VLLM_*, HF_*, TORCH* ones, and
    PYTHONPATH led by the folder this `vllm` package is in (a source checkout need not be
    installed where Ray starts its workers)."""
    import vllm

    env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}
    root = os.path.dirname(os.path.dirname(os.path.abspath(vllm.__file__)))
    paths = [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                      if p and p != root]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def _joined_existing_cluster(ray: Any) -> bool:
    """Whether ray.init() connected to a cluster started elsewhere (`ray start`)."""
    try:
        return not ray._private.worker.global_worker.node.is_head() or \
            bool(os.environ.get("RAY_ADDRESS"))
    except Exception:  # noqa: BLE001 - private API moved: assume ours
        return False

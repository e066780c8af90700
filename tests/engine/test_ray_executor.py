"""The Ray executor on a local Ray cluster of two logical nodes (`ray.cluster_utils.Cluster`,
2 CPUs each, one cluster for the module): TP=2 x PP=2 placed across both nodes gives
transformers' greedy tokens; a killed actor marks the engine dead at once, naming its rank and
node, and shutdown removes the placement group and the actors; more ranks than the cluster's
CPUs is a clear error before anything starts."""
from __future__ import annotations

import asyncio
import time

import pytest

ray = pytest.importorskip("ray")

from engine_test_utils import MAX_TOKENS, PROMPTS  # noqa: E402

from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.engine.async_llm import AsyncLLM, EngineDeadError  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402

# ray.init() without an address joins a cluster already running on the machine: another
# test's local cluster must not be joined (and then shut down under it), so every test that
# starts one runs on the same xdist worker (--dist loadgroup, pyproject.toml).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray_cluster")]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    c.add_node(num_cpus=2)
    ray.init(address=c.address, logging_level="warning")
    yield c
    ray.shutdown()
    c.shutdown()


def engine_args(path: str, tp: int, pp: int) -> EngineArgs:
    return EngineArgs(model=path, optimization_level=0, tensor_parallel_size=tp,
                      pipeline_parallel_size=pp, max_model_len=128, kv_cache_memory="16MiB",
                      disable_log_stats=True)


async def final(llm: AsyncLLM, rid: str, prompt: str):
    last = None
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    async for out in llm.generate(prompt, params, rid):
        last = out
    return last


def wait_until(predicate, timeout: float, what: str) -> None:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not {what} after {timeout} s")
        time.sleep(0.05)


def test_tp2_pp2_across_nodes_then_rank_death(cluster, llama_path, hf_greedy):
    from ray.util.placement_group import placement_group_table

    # Inside a Ray job the backend defaults to Ray.
    llm = AsyncLLM.from_engine_args(engine_args(llama_path, 2, 2))
    try:
        executor = llm.engine.executor
        assert type(executor).__name__ == "RayExecutor"
        assert len(set(executor._nodes)) == 2  # both logical nodes hold ranks
        # Each tensor-parallel group (ranks 0-1, 2-3) on one node.
        nodes = executor._nodes
        assert nodes[0] == nodes[1] and nodes[2] == nodes[3]

        async def main():
            return await asyncio.gather(*(final(llm, f"r{i}", p)
                                          for i, p in enumerate(PROMPTS[:3])))

        outputs = asyncio.run(asyncio.wait_for(main(), 300))
        for prompt, out in zip(PROMPTS[:3], outputs):
            assert list(out.outputs[0].token_ids) == hf_greedy(prompt), prompt

        # Kill a rank of the last stage while the engine is idle: the engine knows at once.
        pg_id = executor._pg.id.hex()
        actors = list(executor._actors)
        ray.kill(actors[3], no_restart=True)
        wait_until(lambda: llm.errored, 60, "errored")
        message = str(llm.dead_error)
        assert "Ray worker rank 3 on node" in message and executor._nodes[3] in message
        with pytest.raises(EngineDeadError, match="rank 3"):
            asyncio.run(asyncio.wait_for(final(llm, "late", PROMPTS[0]), 60))
    finally:
        start = time.monotonic()
        llm.shutdown()
        assert time.monotonic() - start < 30
    assert placement_group_table()[pg_id]["state"] == "REMOVED"
    for actor in actors[:3]:  # the live ones were stopped too
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.node_info.remote(), timeout=30)


def test_more_ranks_than_cpus_is_a_clear_error(cluster, llama_path):
    from vllm import LLM

    start = time.monotonic()
    with pytest.raises(ValueError, match=r"world_size 8 .* needs one CPU per rank; the Ray "
                                         r"cluster has 4 CPUs \(2 nodes"):
        LLM(model=llama_path, optimization_level=0, tensor_parallel_size=4,
            pipeline_parallel_size=2, distributed_executor_backend="ray",
            max_model_len=128, kv_cache_memory="16MiB")
    assert time.monotonic() - start < 60


def test_unplaceable_group_times_out_with_a_clear_error(cluster, llama_path, monkeypatch):
    """The cluster has the CPUs but another job holds them: the placement group waits
    VLLM_RAY_PLACEMENT_TIMEOUT_S, then start-up fails naming it, and removes its group."""
    from ray.util.placement_group import (
        placement_group,
        placement_group_table,
        remove_placement_group,
    )

    from vllm import LLM

    holder = placement_group([{"CPU": 1.0}] * 3, strategy="PACK")
    ray.get(holder.ready(), timeout=60)
    monkeypatch.setenv("VLLM_RAY_PLACEMENT_TIMEOUT_S", "3")
    before = set(placement_group_table())
    try:
        with pytest.raises(RuntimeError, match=r"placement group of 2 CPU bundles .* was not "
                                               r"placed within 3 s"):
            LLM(model=llama_path, optimization_level=0, tensor_parallel_size=2,
                distributed_executor_backend="ray", max_model_len=128,
                kv_cache_memory="16MiB")
        ours = [pg for pg_id, pg in placement_group_table().items() if pg_id not in before]
        assert ours and all(pg["state"] == "REMOVED" for pg in ours)
    finally:
        remove_placement_group(holder)


def test_server_exits_1_when_a_ray_worker_dies(cluster, llama_path, tmp_path):
    """`vllm serve -tp 2 --distributed-executor-backend ray` on the cluster (RAY_ADDRESS): a
    killed rank-1 actor makes the server exit 1, its log naming the rank and node."""
    import os
    import re
    import signal
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "entrypoints"))
    from server_utils import RemoteServer

    server = RemoteServer("vllm.entrypoints.cli.main",
                          ["serve", llama_path, "-O0", "--tensor-parallel-size", "2",
                           "--distributed-executor-backend", "ray", "--max-model-len", "128",
                           "--kv-cache-memory", "16MiB"],
                          env={"RAY_ADDRESS": cluster.address}, log_dir=str(tmp_path))
    try:
        found = re.search(r"rank 1 on (\S+ \(\w+\)) \(pid (\d+)\)", server.log())
        assert found, server.log()
        node, pid = found.group(1), int(found.group(2))
        with open(f"/proc/{pid}/cmdline", "rb") as f:  # our cluster's actor, nothing else
            assert b"RayWorker" in f.read()
        os.kill(pid, signal.SIGKILL)
        returncode = server.proc.wait(timeout=90)
        log = server.log()
        assert returncode == 1, log
        assert f"Ray worker rank 1 on node {node} died" in log, log
    finally:
        server.stop()

"""The "buffer" layout through ExecuTorch's lowering, on the CPU (``e2e``: minutes on two cores).

lingbot-va-tiny's DiT methods in the buffer layout are lowered by zoo's own per-method lowering, constant plan,
assembly and extraction, with ExecuTorch's AOTI backend compiling for the CPU (tests/fixtures/aoti_cpu_probe.py:
the CUDA backend's code path with the device set to ``cpu``). What that shows without a GPU:

* Inductor writes the new slots into each layer's pool buffer in place (a scatter over the step's new tokens),
  and no kernel writes a whole layer of the pool: read off the generated C++;
* the pool buffers are constants of both methods' ``.so`` (the lowering's ``mutable_buffers``), the constant
  plan gives both one table, and the ``.ptd`` stores both weights blobs as one segment, which is what makes
  ExecuTorch's weight sharing give ``action_step`` ``video_step``'s pool;
* zoo.runner over the compiled ``.so`` files in torch's AOTI (CPU) containers, the pool shared by
  ``SharedConstants`` as the artifact backend shares it on a GPU, passes the policy check against LeRobot's
  ``select_action`` over two episodes on one runner; the VAE methods, not lowered here, run as eager programs.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("lerobot")
pytestmark = [pytest.mark.e2e, pytest.mark.policies]

from zoo.contract.artifact import extract_method_files, read_ptd_entries  # noqa: E402
from zoo.contract.run_folder import RunFolder  # noqa: E402
from zoo.export.lower import lowering  # noqa: E402
from zoo.export.policy_check import checkpoint_in_reach, episode  # noqa: E402
from zoo.runner.backends import EagerBackend, _in_words  # noqa: E402
from zoo.runner.check import ProcessedPolicy, compare_episode, run_episode  # noqa: E402
from zoo.runner.lingbot_va import DIT_METHODS, LingBotVARunner  # noqa: E402
from zoo.runtimes.aoti import SharedConstants, promote_libtorch_global, run_in_delegate_order  # noqa: E402
from support import shared_runs  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from aoti_cpu_probe import PROBE_LOWERING  # noqa: E402

BUFFER = ["lowering.kv_pool=buffer", "policy_check.episodes=2"]  # the same run as test_lingbot_va_runner.py's


@pytest.fixture(scope="module")
def lowered(shared_cache, tmp_path_factory):
    """The buffer run with its DiT methods lowered for the CPU; Inductor's generated code kept in ``code``."""
    exported = shared_runs.tiny_run(shared_cache, "lingbot-va-tiny", BUFFER, label="kv-buffer")
    exported.check_exported()
    run = RunFolder(exported.copy_to(tmp_path_factory.mktemp("lowered")))
    recipe = run.load_recipe()
    recipe.unit.methods = list(DIT_METHODS)
    code = tmp_path_factory.mktemp("inductor")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(code))
        result = lowering.lower_to_pte({m: run.program("rewritten", m) for m in DIT_METHODS}, run, recipe,
                                       workers=1, method_lowering=PROBE_LOWERING, run_preflight=False)
    return {"run": run, "recipe": recipe, "code": code, "result": result}


# --- the generated code: a scatter of the new slots, in place ------------------------------------------------------

_FOR = re.compile(r"for\(int64_t \w+=static_cast<int64_t>\((-?\d+)L\); \w+<static_cast<int64_t>\((\d+)L\)")


def _kernels(source: str):
    """{kernel name: (parameter names, body lines)} of Inductor's C++ kernels."""
    out = {}
    for match in re.finditer(r'extern "C"\s+void\s+(\w+)\(([^)]*)\)\s*\{', source):
        depth, end = 1, match.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(source[end], 0)
            end += 1
        params = [p.split()[-1].lstrip("*") for p in match.group(2).split(",")]
        out[match.group(1)] = (params, source[match.end():end].splitlines())
    return out


def _write_sizes(lines, param: str):
    """The number of elements each statement writing ``param[...]`` writes: the product of its loops' trips."""
    loops, depth, sizes = [], 1, []
    for line in lines:
        if re.search(rf"\b{param}\[[^\]]*\]\s*=[^=]", line):
            sizes.append(int(torch.tensor([trip for _, trip in loops] or [1]).prod()))
        found = _FOR.search(line)
        if found:
            loops.append((depth + 1, int(found.group(2)) - int(found.group(1))))
        for ch in line:
            if ch == "{":
                depth += 1
            elif ch == "}":
                loops = [(d, t) for d, t in loops if d != depth]
                depth -= 1
    return sizes


def pool_writes(code: Path, pools):
    """Per pool buffer, the sizes of the writes into it, over every kernel call of every generated wrapper."""
    kernels = {}
    for path in code.rglob("*.kernel.cpp"):
        kernels.update(_kernels(path.read_text()))
    writes = {name: [] for name in pools}
    for path in code.rglob("*.wrapper.cpp"):
        for call in re.finditer(r"\b(cpp_fused\w*)\(([^;]*)\);", path.read_text()):
            if call.group(1) not in kernels:
                continue
            params, body = kernels[call.group(1)]
            for i, arg in enumerate(call.group(2).split(", (")):
                named = re.search(r"\((\w+)\.data_ptr\(\)\)", arg)
                if named and named.group(1) in writes and "const" not in arg:
                    writes[named.group(1)] += _write_sizes(body, params[i])
    return writes


def test_inductor_scatters_the_new_slots_into_each_layer_in_place(lowered):
    settings = lowered["run"].read_host_settings()
    pool = settings.kv_pool
    layer = pool.shape[1] * pool.shape[2] * pool.shape[3] * pool.shape[4]  # B x T x H x D elements
    writes = pool_writes(lowered["code"], pool.buffer_names())
    per_step = {pool.video_slots_per_step, pool.action_slots_per_step}
    for name, sizes in writes.items():
        assert sizes, f"no kernel writes {name}"
        assert layer not in sizes, f"a kernel rewrites the whole of {name}: {sizes}"
        assert {s // (pool.shape[1] * pool.shape[3] * pool.shape[4]) for s in sizes} <= per_step, (name, sizes)


# --- what ExecuTorch's runtime is handed ------------------------------------------------------------------------


def test_both_methods_hold_the_pool_as_constants_of_one_table_stored_once(lowered):
    run = lowered["run"]
    names = set(run.read_host_settings().kv_pool.buffer_names())
    for method in DIT_METHODS:
        assert set(run.mutable_buffers(method)) == names  # the delegate writes them in place: constants of its .so
    segments = {e.key: (e.offset, e.size) for e in read_ptd_entries(run.ptd)}
    assert segments["video_step_weights_blob"] == segments["action_step_weights_blob"]
    (group,) = lowered["result"].weights["plan"]["groups"]
    assert group["methods"] == list(DIT_METHODS) and group["applied"] and "state the methods share" in group["why"]


# --- the compiled steps, sharing the pool in torch's AOTI containers, against LeRobot -----------------------------


class CompiledDiTSteps(EagerBackend):
    """The DiT methods' compiled ``.so`` files in torch's AOTI CPU containers, their constants shared as the
    artifact backend shares them (``SharedConstants``); the VAE methods, not lowered here, eager."""

    name = "artifact (CPU)"

    def __init__(self, run: RunFolder, folder: Path):
        super().__init__(run, "cpu")
        promote_libtorch_global()
        self.constants = SharedConstants()
        files = extract_method_files(run.pte, run.ptd, folder, list(DIT_METHODS))
        self.containers = {}
        for method in DIT_METHODS:
            self.containers[method] = torch._C._aoti.AOTIModelContainerRunnerCpu(str(files[method]["so"]), 1)
            self.constants.load(method, self.containers[method], files[method]["weights"], run.mutable_buffers(method))

    def _run(self, method, args):
        if method not in self.containers:
            return super()._run(method, args)
        container = self.containers[method]
        runner = type("Runner", (), {"run": lambda _, inputs: list(container.run([t.contiguous() for t in inputs]))})
        return run_in_delegate_order(runner(), self.run.io_order(method), args)

    def sharing_problem(self, methods, buffers):
        return _in_words(self.constants.unshared({m: self.containers[m] for m in methods}, buffers))


def test_the_compiled_steps_sharing_the_pool_pass_the_policy_check_over_two_episodes(lowered):
    from zoo import policies

    run, recipe = lowered["run"], lowered["recipe"]
    family = policies.load_family("lingbot_va")
    seeds = [recipe.policy_check.seed, recipe.policy_check.seed + 1]
    observations = {s: episode(run, recipe, s) for s in seeds}
    with checkpoint_in_reach(recipe) as checkpoint:
        policy, pre, post = family.lerobot_policy(checkpoint, recipe)
        prompt = family.embed_prompt(policy, recipe.policy_check.task)
        expected = {s: run_episode(ProcessedPolicy(policy, pre, post), observations[s], s) for s in seeds}
    folder = Path(tempfile.mkdtemp())
    try:
        backend = CompiledDiTSteps(run, folder)
        assert "every constant shared with video_step" in backend.constants.how["action_step"]
        runner = LingBotVARunner(run, backend)
        runner.prompts[prompt.task] = prompt
        for seed in seeds:  # one runner: the second episode starts with the first's K/V in the pool
            result = compare_episode(runner, expected[seed], observations[seed], seed=seed)
            assert result.ok, result.table()
    finally:
        shutil.rmtree(folder, ignore_errors=True)

"""``zoo.runner.load``: a run folder (or a published Hub repo) to the family's runner over a backend."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Type, Union

import torch

from zoo.core.errors import RunnerError
from zoo.contract.run_folder import RunFolder
from zoo.runner.backends import BACKENDS, make_backend
from zoo.runner.base import Embedder, PolicyRunner
from zoo.runner.fast_wam import FastWAMRunner
from zoo.runner.graphs import GraphedArtifactBackend
from zoo.runner.lingbot_va import LingBotVARunner

# policy_type (host_settings.json) -> its host loop.
RUNNERS: Dict[str, Type[PolicyRunner]] = {r.policy_type: r for r in (FastWAMRunner, LingBotVARunner)}

__all__ = ["BACKENDS", "RUNNERS", "load", "resolve", "runner_families"]


def runner_families() -> List[str]:
    """The zoo families the runner has a host loop for (``zoo.policies`` names)."""
    return sorted(r.family for r in RUNNERS.values())


def resolve(source: Union[str, Path, RunFolder]) -> RunFolder:
    """A run folder as given, or a Hub repo id downloaded (the user's cache, ``HF_HUB_OFFLINE`` honoured)."""
    if isinstance(source, RunFolder):
        return source
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise RunnerError(f"{path} is a file, not a run folder",
                              "pass the folder `python -m zoo.export` wrote, or a published repo id")
        return RunFolder(path)
    text = str(source)
    if text.count("/") == 1 and not text.startswith((".", "/", "~")):
        from huggingface_hub import snapshot_download

        try:
            return RunFolder(snapshot_download(text))
        except Exception as exc:  # network, auth, offline-and-not-cached: all mean "not available here"
            raise RunnerError(f"cannot get {text!r} from the Hugging Face Hub: {type(exc).__name__}: {exc}",
                              "check the repo id and the network, or pass a local run folder") from None
    raise RunnerError(f"{source} is neither a folder nor a Hub repo id (ORG/NAME)",
                      "pass a run folder written by `python -m zoo.export`, or a published repo id")


def load(source: Union[str, Path, RunFolder], backend: str = "eager", device: Optional[str] = None,
         processors: bool = True, et_runner: Optional[Union[str, Path]] = None,
         embedder: Optional[Embedder] = None, cuda_graphs: bool = False) -> PolicyRunner:
    """The runner of a run folder or published artifact.

    ``backend``: ``"eager"`` runs the rewritten programs (``rewritten.<method>.pt2``) with PyTorch, on the CPU by
    default or on ``device``; ``"artifact"`` runs each method's shipped ``.so`` and weights (taken out of
    ``model.pte`` / ``aoti_cuda_blob.ptd``) through torch's AOTI runner, on ``cuda`` by default; ``"executorch"``
    runs ``model.pte`` + ``aoti_cuda_blob.ptd`` in ExecuTorch's own C++ runtime (``et_runner``, else
    ``$ZOO_ET_RUNNER``: a zoo_runner of the release the artifact needs), the state the host loop hands from call
    to call held there on the GPU; ``device`` is then where the host loop's own arithmetic runs (``cuda`` where
    torch has it, else the CPU); ``"executorch-inprocess"`` runs the same runtime loaded into this process
    (``libzoo_session.so``: ``$ZOO_ET_SESSION``, else beside ``$ZOO_ET_RUNNER``), on ``cuda``, in a process that
    never runs torch's AOTI runner (docs/runtime.md, "In this process").
    ``processors=False`` leaves the run's normalisation processors to the caller (``runner.preprocessor``,
    ``runner.postprocessor``), as LeRobot's own loop applies them around a policy.
    ``embedder``: what embeds a task that has no prompt file yet (``embedder(task) -> PromptEmbedding``, with the
    policy's own text encoder; lerobot_policy_zoo has one); the runner stores its output in the run's
    ``prompts/`` and loads it from there afterwards. Without one, such a task is refused with the command that
    makes its prompt file.
    ``cuda_graphs=True`` (backend ``"artifact"``): each method is captured once per input shapes in a CUDA graph and
    replayed, the state the host loop hands on kept in one GPU buffer per name (``zoo.runner.graphs``): the host's
    kernel launches leave the call, for one device copy of each state output.
    """
    run = resolve(source)
    settings = run.read_host_settings()
    kind = settings.policy_type
    if kind not in RUNNERS:
        known = ", ".join(sorted(RUNNERS))
        raise RunnerError(f"zoo.runner has no host loop for the policy in {run.path} (family {settings.family!r}, "
                          f"policy_type {kind!r})", f"the runner drives these policy types: {known}")
    if device is None:
        device = {"artifact": "cuda", "executorch-inprocess": "cuda",
                  "executorch": "cuda" if torch.cuda.is_available() else "cpu"}.get(backend, "cpu")
    if cuda_graphs:
        if backend != "artifact":
            raise RunnerError(f"cuda_graphs=True replays the artifact's .so files; backend {backend!r} cannot",
                              "pass backend='artifact' (ExecuTorch 1.2's runtime has no CUDA graph mode)")
        chosen = GraphedArtifactBackend(run, device, list(run.read_io_spec().methods))
    else:
        chosen = make_backend(backend, run, device, et_runner=str(et_runner) if et_runner else None)
    return RUNNERS[kind](run, chosen, processors=processors, embedder=embedder)

"""The runner every family shares: loading a run, the processors, prompts, and LeRobot's three calls.

``runner = zoo.runner.load(RUN_DIR_or_hub_repo_id, backend="eager"|"artifact", device=...)`` gives an object
with LeRobot's policy interface: ``reset()``, ``select_action(batch) -> action`` and
``predict_action_chunk(batch) -> chunk``. By default the run folder's processors are applied around them, so
``batch`` is the raw observation dict a LeRobot control loop hands its preprocessor, and the action comes back
unnormalised, as the postprocessor returns it. With ``processors=False`` the runner takes and returns what
the policy itself takes and returns; ``runner.preprocessor`` / ``runner.postprocessor`` are then the
pipelines to use around it, as in LeRobot's own loop.

No lerobot, transformers or diffusers here: the family runners reproduce LeRobot's host loops from the
numbers the export wrote into ``host_settings.json``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional, Union

import torch

from .backends import Backend, make_backend
from .errors import RunnerError
from .processors import load_processors
from .prompt import PromptEmbedding
from .run_files import RunFiles

Batch = Dict[str, Any]


class PolicyRunner:
    """Shared machinery; a family subclass implements ``_reset``, ``_select_action``, ``_predict_action_chunk``
    on preprocessed batches returning normalised actions, exactly as the LeRobot policy's methods do."""

    policy_type = "?"

    def __init__(self, run: RunFiles, backend: Backend, processors: bool = True):
        self.run = run
        self.backend = backend
        self.device = backend.device
        self.settings = run.host_settings
        self.dtype = getattr(torch, run.unit_dtype)
        self.preprocessor, self.postprocessor = load_processors(run.processors_dir, str(self.device))
        self.apply_processors = bool(processors)
        self.prompts: Dict[str, PromptEmbedding] = {}
        self._configure()
        self.reset()

    # --- LeRobot's interface ---------------------------------------------------------------------------------

    def reset(self) -> None:
        """Start a new episode: empty the action queue and every piece of streaming state."""
        self.chunks_predicted = 0  # chunks predicted this episode (the policy check groups actions by it)
        self._reset()

    @torch.no_grad()
    def select_action(self, batch: Batch) -> torch.Tensor:
        action = self._select_action(self._pre(batch))
        return self._post(action)

    @torch.no_grad()
    def predict_action_chunk(self, batch: Optional[Batch]) -> torch.Tensor:
        chunk = self._predict_action_chunk(None if batch is None else self._pre(batch))
        return self._post(chunk)

    # --- prompts ---------------------------------------------------------------------------------------------

    def load_prompt(self, path: Union[str, Path]) -> PromptEmbedding:
        """Make a prompt embedding file (``python -m zoo prompt``) available for its task text."""
        prompt = PromptEmbedding.load(Path(path))
        if prompt.policy_type != self.policy_type:
            raise RunnerError(f"{path} was computed for a {prompt.policy_type!r} policy, this run is "
                              f"{self.policy_type!r}", 'compute it for this run: python -m zoo prompt RUN_DIR "task"')
        self.prompts[prompt.task] = prompt
        return prompt

    def prompt_for(self, task: Any = None, text: Any = None) -> PromptEmbedding:
        """The loaded embedding of a batch's ``task`` (or of the exact encoder ``text``, for a ``prompt`` key)."""
        value = text if text is not None else task
        if isinstance(value, (list, tuple)):
            if len(value) != 1:
                raise RunnerError(f"the batch holds {len(value)} tasks; one runner drives one environment",
                                  "run one runner per environment")
            value = value[0]
        if text is not None:
            found = [p for p in self.prompts.values() if p.text == value]
        else:
            found = [self.prompts[value]] if value in self.prompts else []
        if not found:
            known = ", ".join(repr(t) for t in self.prompts) or "none loaded"
            raise RunnerError(f"no prompt embedding for {'prompt' if text is not None else 'task'} {value!r} "
                              f"(tasks loaded: {known})",
                              f'compute it once: python -m zoo prompt {self.run.path} "{value}" -o FILE, then '
                              "runner.load_prompt(FILE)")
        return found[0]

    # --- helpers ---------------------------------------------------------------------------------------------

    def _pre(self, batch: Batch) -> Batch:
        return self.preprocessor(dict(batch)) if self.apply_processors else dict(batch)

    def _post(self, action: torch.Tensor) -> torch.Tensor:
        return self.postprocessor.action(action) if self.apply_processors else action

    def call(self, method: str, **inputs: torch.Tensor) -> Dict[str, torch.Tensor]:
        return self.backend.call(method, **inputs)

    def close(self) -> None:
        self.backend.close()

    # --- family hooks ----------------------------------------------------------------------------------------

    def _configure(self) -> None:
        """Read what the family needs from ``self.settings`` (host_settings.json), before the first reset."""
        raise NotImplementedError

    def _reset(self) -> None:
        raise NotImplementedError

    def _select_action(self, batch: Batch) -> torch.Tensor:
        raise NotImplementedError

    def _predict_action_chunk(self, batch: Optional[Batch]) -> torch.Tensor:
        raise NotImplementedError


def _family_runners() -> Dict[str, type]:
    from .fast_wam import FastWAMRunner
    from .lingbot_va import LingBotVARunner

    return {r.policy_type: r for r in (FastWAMRunner, LingBotVARunner)}


def resolve(source: Union[str, Path]) -> Path:
    """A run folder as given, or a Hub repo id downloaded (the user's cache, ``HF_HUB_OFFLINE`` honoured)."""
    path = Path(source).expanduser()
    if path.exists():
        return path
    text = str(source)
    if text.count("/") == 1 and not text.startswith((".", "/", "~")):
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(text))
        except Exception as exc:  # network, auth, offline-and-not-cached: all mean "not available here"
            raise RunnerError(f"cannot get {text!r} from the Hugging Face Hub: {type(exc).__name__}: {exc}",
                              "check the repo id and the network, or pass a local run folder") from None
    raise RunnerError(f"{source} is neither a folder nor a Hub repo id (ORG/NAME)",
                      "pass a run folder written by `python -m zoo.export`, or a published repo id")


def load(source: Union[str, Path], backend: str = "eager", device: Optional[str] = None,
         processors: bool = True) -> PolicyRunner:
    """The runner of a run folder or published artifact: ``backend`` ``"eager"`` (the rewritten programs, CPU
    or GPU; the default device is the CPU) or ``"artifact"`` (the shipped .so's through torch's AOTI runner;
    the default device is ``cuda``)."""
    run = RunFiles(resolve(source))
    device = device or ("cuda" if backend == "artifact" else "cpu")
    runners = _family_runners()
    if run.policy_type not in runners:
        raise RunnerError(f"zoo.runner has no host loop for {run.policy_type!r} policies yet",
                          f"runners exist for: {', '.join(runners)}")
    return runners[run.policy_type](run, make_backend(backend, run, device), processors=processors)

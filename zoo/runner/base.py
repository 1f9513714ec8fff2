"""The runner every family shares: a run folder's settings, processors and prompts, and LeRobot's three calls.

A runner has LeRobot's policy interface: ``reset()``, ``select_action(batch) -> action`` and
``predict_action_chunk(batch) -> chunk``. By default the run folder's processors are applied around them, so
``batch`` is the raw observation dict a LeRobot control loop hands its preprocessor, and the action comes back
unnormalised, as the postprocessor returns it. With ``processors=False`` the runner takes and returns what the
policy itself takes and returns; ``runner.preprocessor`` / ``runner.postprocessor`` are then the pipelines to
use around it, as in LeRobot's own loop.

No lerobot, transformers or diffusers here: the family runners reproduce LeRobot's host loops from the numbers
the export wrote into ``host_settings.json``, and read the run folder only through ``zoo.contract.run_folder.RunFolder``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, Optional, Union

import torch

from zoo.core.errors import RunnerError
from zoo.core.progress import say, warn
from zoo.contract.host_settings import HostSettings
from zoo.contract.run_folder import RunFolder
from zoo.runner.backends import Backend
from zoo.runner.processors import load_processors
from zoo.runner.prompt import PromptEmbedding

Batch = Dict[str, Any]
# Embeds a task text the run has no prompt file for: ``embedder(task) -> PromptEmbedding``. It runs the policy's
# own text encoder, which the deploy side does not import; a caller that has it (LeRobot's environment, the
# lerobot_policy_zoo plugin) passes one to ``zoo.runner.load``.
Embedder = Callable[[str], PromptEmbedding]


class PolicyRunner:
    """Shared machinery; a family subclass implements ``_configure``, ``_reset``, ``_select_action`` and
    ``_predict_action_chunk`` on preprocessed batches returning normalised actions, exactly as the LeRobot
    policy's methods do, and counts ``chunks_predicted``."""

    policy_type = "?"  # host_settings.json's policy_type (LeRobot's config "type")
    family = "?"  # the zoo family (zoo.policies) whose runs this drives

    def __init__(self, run: RunFolder, backend: Backend, processors: bool = True,
                 embedder: Optional[Embedder] = None):
        self.run = run
        self.embedder = embedder
        self.backend = backend
        self.device = backend.device
        self.settings = run.read_host_settings()
        self.dtype = getattr(torch, backend.io_spec.dtype)
        self.preprocessor, self.postprocessor = load_processors(run, str(self.device))
        self.apply_processors = bool(processors)
        self.prompts: Dict[str, PromptEmbedding] = {}
        for path in run.prompt_files():  # `python -m zoo prompt RUN_DIR "task"` without -o puts them here
            self.load_prompt(path)
        backend.keep_state(self.device_state(self.settings))
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
                              f"{self.policy_type!r}", f'compute it for this run: python -m zoo prompt '
                                                       f'{self.run.path} "TASK"')
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
        if not found and text is None and self.embedder is not None:
            found = [self._embed(value)]
        if not found:
            known = ", ".join(repr(t) for t in self.prompts) or "none loaded"
            raise RunnerError(f"no prompt embedding for {'prompt' if text is not None else 'task'} {value!r} "
                              f"(tasks loaded: {known})",
                              f'compute it once: python -m zoo prompt {self.run.path} "{value}" (or -o FILE, then '
                              "runner.load_prompt(FILE)); where the policy's text encoder is installed, "
                              "zoo.runner.load(..., embedder=...) embeds new tasks by itself")
        return found[0]

    def _embed(self, task: str) -> PromptEmbedding:
        """A task seen for the first time, embedded by ``self.embedder`` and kept in the run's ``prompts/`` (one
        atomic write: a reader never sees half a file), so that later runners load it instead of embedding."""
        say(f"embedding the new task {task!r} with the policy's own text encoder (once; kept in "
            f"{self.run.prompts_dir}) ...")
        prompt = self.embedder(task)
        if prompt.policy_type != self.policy_type or prompt.task != task:
            raise RunnerError(f"the embedder returned a prompt for task {prompt.task!r} of a {prompt.policy_type!r} "
                              f"policy; this run needs task {task!r} for {self.policy_type!r}",
                              "pass an embedder built for this run")
        path = self.run.prompt_file(task)
        try:
            prompt.save(path)
        except OSError as exc:  # a read-only run (a Hub snapshot on a read-only disk): embed again next time
            warn(f"cannot keep the embedding of {task!r} in {path}: {exc}; it is used for this runner only")
        self.prompts[task] = prompt
        return prompt

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

    @classmethod
    def device_state(cls, settings: HostSettings) -> Dict[str, Dict[str, str]]:
        """The outputs this host loop feeds back into later calls, ``{method: {output: name}}``, each under the
        name of the input it goes back to: a backend keeps them where the runtime left them (the GPU)."""
        return {}

    @classmethod
    def episode_steps(cls, settings: HostSettings, chunks: int) -> int:
        """How many ``select_action`` calls an episode takes to predict ``chunks`` whole action chunks and
        start one more (so the last chunk's feedback, where a policy has one, runs too)."""
        raise NotImplementedError

    def _configure(self) -> None:
        """Read what the family needs from ``self.settings`` (host_settings.json), before the first reset."""
        raise NotImplementedError

    def _reset(self) -> None:
        raise NotImplementedError

    def _select_action(self, batch: Batch) -> torch.Tensor:
        raise NotImplementedError

    def _predict_action_chunk(self, batch: Optional[Batch]) -> torch.Tensor:
        raise NotImplementedError

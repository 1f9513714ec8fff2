"""A hand-written manifest, as ``zoo.export.publish.manifest`` writes one, for the model-card tests."""

from __future__ import annotations


def manifest(**changes):
    base = {
        "recipe": {"name": "lingbot-va", "family": "lingbot_va", "description": "",
                   "source": {"repo_id": "robbyant/lingbot-va", "fabricate": False}, "unit": {"dtype": "bfloat16"},
                   "dynamic": {}},
        "overrides": [],
        "source": {"repo_id": "robbyant/lingbot-va", "revision": "main", "commit": "c" * 40},
        "license": {"license": "apache-2.0", "from": "source.json"},
        "versions": {"zoo": "0.1.0", "torch": "2.11.0+cu130", "executorch": "1.2.0", "lerobot": None},
        "gpu": {"built_for": {"name": "NVIDIA A100-SXM4-80GB", "compute_capability": "8.0"},
                "verified_on": {"name": "NVIDIA A100-SXM4-80GB", "compute_capability": "8.0"}},
        "rewrites": {},
        "audit": {"1.2": {"loadable": True, "missing_symbols": []}},
        "verification": {"passed": True, "rows": [
            {"method": "video_step", "seed": 3, "sizes": {}, "output": "noise_pred", "max_abs": 0.0123456,
             "rel_l2": 0.00871, "cosine": 0.999961234, "ok": True, "why": ""}]},
        "files": {"model.pte": {"sha256": "a" * 64, "size": 2_500_000},
                  "processors/stats.safetensors": {"sha256": "b" * 64, "size": 999}},
    }
    base.update(changes)
    return base

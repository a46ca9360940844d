"""The options of pebbling's Ray Serve deployment (ray_deploy.py), and the Serve settings they decide:
how many replicas (fixed, or autoscaled by the requests queued or running on each) and how many requests
a replica and the front take. Plain Python: it imports nothing of Ray, so it is read and tested alone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from ..errors import PebblingError
from .settings import DEFAULT_MAX_QUEUE, parallel_limit

TARGET = "target_ongoing_requests"


@dataclass
class RayConfig:
    """The deployment's options; `replica()` is what each replica's engine is built from."""
    models: str | None = None          # the models directory (default: registry.default_models_dir())
    num_replicas: int = 1
    num_gpus: float = 0                # per replica; 0 on CPU
    num_cpus: float = 1                # per replica, as Ray reserves them
    max_queue: int = DEFAULT_MAX_QUEUE  # per replica: requests queued or running, 503 beyond
    max_context: int | None = None
    num_parallel: int | None = None
    parked_kv_mib: int | None = None
    backend: str | None = None
    options: dict = field(default_factory=dict)  # defaults for every request's options
    host: str | None = None            # where Serve listens, for the Host checks (PEBBLING_HOST)
    # Serve's autoscaling_config (min_replicas, max_replicas, target_ongoing_requests, ...) in place of
    # num_replicas: see `scaling`.
    autoscaling: dict | None = None

    @classmethod
    def from_args(cls, args: dict | None) -> "RayConfig":
        args = dict(args or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise PebblingError(f"unknown pebbling Ray option(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}")
        config = cls(**args)
        if not (isinstance(config.num_replicas, int) and config.num_replicas >= 1):
            raise PebblingError(f"num_replicas is {config.num_replicas!r}; give a whole number of at least 1")
        if not (isinstance(config.max_queue, int) and config.max_queue >= 1):
            raise PebblingError(f"max_queue is {config.max_queue!r}; give a whole number of at least 1")
        if config.autoscaling is not None and not isinstance(config.autoscaling, dict):
            raise PebblingError(f"autoscaling is {config.autoscaling!r}; give a mapping of Serve's autoscaling_config")
        if not isinstance(config.options, dict):
            raise PebblingError(f"options is {config.options!r}; give a mapping of request options")
        config.scaling()  # refuses a target the replicas could never reach
        return config

    def replica(self) -> dict:
        settings = {k: v for k, v in asdict(self).items()
                    if k not in ("num_replicas", "num_gpus", "num_cpus", "autoscaling")}
        # The host library's threads: as many as the CPUs Ray reserves for the replica, so that replicas
        # sharing a machine do not each start one per core.
        settings["threads"] = max(1, int(self.num_cpus)) if self.num_cpus >= 1 else None
        return settings

    def scaling(self) -> dict:
        """The replicas' Serve options for their number and load: num_replicas, or autoscaling_config.

        Autoscaled, replicas follow the requests queued or running on each (Serve's ongoing requests), a
        signal whose ceiling is max_queue: Serve sends a replica no more (max_ongoing_requests), as the
        engine answers 503 past it. The target a replica is held to defaults to the requests it decodes
        together (num_parallel, so the ones beyond wait in its queue), at most max_queue; a target above
        max_queue is refused, as the signal never reaches it and no replica would be added."""
        options: dict = {"max_ongoing_requests": self.max_queue}
        if self.autoscaling is None:
            return {**options, "num_replicas": self.num_replicas}
        target = self.autoscaling.get(TARGET, min(self.num_parallel or parallel_limit(), self.max_queue))
        if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target <= self.max_queue:
            raise PebblingError(f"autoscaling {TARGET} is {target!r}; give a number above 0 and at most "
                                f"max_queue ({self.max_queue}), the requests a replica takes before it answers 503")
        return {**options, "autoscaling_config": {**self.autoscaling, TARGET: target}}

    def most_replicas(self) -> int:
        """The replicas there can be at once (Serve's max_replicas defaults to 1)."""
        return int(self.autoscaling.get("max_replicas", 1)) if self.autoscaling is not None else self.num_replicas

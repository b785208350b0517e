"""Prefix-aware replica choice for `treadle serve --ray`: Ray Serve LLM's PrefixCacheAffinityRouter.

Ray ships the router we want (a prefix tree of the prompts each replica has served; the longest
match wins while the replicas' queue lengths differ by at most `imbalanced_threshold`, otherwise
Ray's power-of-two-choices picks the less loaded one). It reads `.prompt` or `.messages` from the
call's first argument; `app.ray.deployment.RoutedRequest` carries both.

Two adjustments, both here:

- the public path `ray.serve.llm.request_router` imports all of Ray Serve LLM (pyarrow, ...), which
  `ray[serve]` does not install; the class itself lives in a module that needs nothing more, so it is
  imported from there (the public class is a plain subclass of it);
- Ray creates its prefix-tree actor with the default resources, which asks for one CPU to schedule;
  on a machine whose CPUs are all held by replicas that actor would never start and routing would
  hang. Here it asks for none.
"""

from __future__ import annotations

from typing import Any

import ray

try:  # the module that holds the class; `ray.serve.llm.request_router` re-exports it (and needs ray[llm])
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
        PrefixCacheAffinityRouter,
    )
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTreeActor
except ImportError:  # pragma: no cover - a Ray that moved it; the public path then (needs ray[llm])
    from ray.serve.llm.request_router import PrefixCacheAffinityRouter  # type: ignore[no-redef]
    PrefixTreeActor = None  # type: ignore[assignment,misc]

# Load difference (requests queued at the replica) beyond which affinity yields to load balance.
DEFAULT_IMBALANCED_THRESHOLD = 4


class TreadlePrefixRouter(PrefixCacheAffinityRouter):
    """PrefixCacheAffinityRouter whose prefix-tree actor needs no CPU (see the module's docstring)."""

    def initialize_state(self, imbalanced_threshold: float = DEFAULT_IMBALANCED_THRESHOLD,
                         tree_actor: Any = None, **kwargs: Any) -> None:
        if tree_actor is None and PrefixTreeActor is not None:
            from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

            deployment = self._deployment_id
            namespace = "::".join(x for x in (SERVE_NAMESPACE, deployment and deployment.app_name,
                                              deployment and deployment.name) if x)
            tree_actor = PrefixTreeActor.options(name="TreadlePrefixTreeActor", namespace=namespace,
                                                 get_if_exists=True, lifetime="detached", num_cpus=0).remote()
            controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
            ray.get(controller._register_shutdown_cleanup_actor.remote(tree_actor))  # gone on serve.shutdown()
        super().initialize_state(imbalanced_threshold=imbalanced_threshold, tree_actor=tree_actor, **kwargs)

    def _extract_text_from_request(self, pending_request: Any) -> str | None:
        """The prompt text the ingress put on the request; None (no prefix matching) when there is none
        (/v1/models, /tokenize, ...; Ray's own version raises there, or divides by its empty length)."""
        for arg in pending_request.args or ():
            text = getattr(arg, "prompt", None)
            if isinstance(text, str) and text:
                return text
        return None

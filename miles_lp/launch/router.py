"""``rollout.url`` naming an sglang-router: the servers behind it become the run's engines.

sglang-router (0.3.2) spreads ``/generate`` requests over its servers but has no weight-update route, while every
server must be updated after each RL step and checked (C1-C7 per engine). So at start the router is asked for its
servers (``GET /workers``) and the run addresses each one directly, exactly as if the recipe had listed them in
``rollout.urls``: miles-lp spreads the prompts itself (each GRPO group on one server, so its prefix cache holds
the prompt once; one sampling seed per group, so the samples do not depend on which server took them), syncs
and checks every server, and regenerates a dead server's groups on the replacement. The router keeps serving
other clients; the run does not send requests through it.

The run folder's recipe.yaml is the effective recipe: it lists the servers (``rollout.urls``), so a resume
addresses the servers the run was synced with.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from collections.abc import Callable

from miles_lp.config import YamlDoc
from miles_lp.errors import ConfigError
from miles_lp.launch.recipe import Recipe, parse_recipe
from miles_lp.rollout.engine import EngineError


def _stderr(line: str) -> None:
    print(f"miles-lp run: {line}", file=sys.stderr, flush=True)


def with_router_workers(recipe: Recipe, *, log: Callable[[str], None] = _stderr) -> Recipe:
    """``recipe`` with ``rollout.url`` replaced by ``rollout.urls`` = the router's servers when that url is an
    sglang-router; unchanged otherwise (another backend, a server, an address that does not answer: the engine's
    own probe reports it). A router inside ``rollout.urls`` is refused (it would be synced as if it were one server)."""
    from miles_lp.rollout.sglang import SGLangHTTPEngine  # urllib only; the other backends never load it

    ro = recipe.rollout
    if ro.backend != "sglang" or ro.server == "launch" or not ro.url:
        return recipe
    listed = recipe.fleet.urls
    for i, url in enumerate(listed or (ro.url,)):
        key = f"rollout.urls[{i}]" if listed else "rollout.url"
        where, _ = recipe.origin("rollout.urls" if listed else "rollout.url")
        try:
            workers = SGLangHTTPEngine(url, flavor=ro.server).router_workers()
        except EngineError as exc:
            raise ConfigError(f"{where}: {key}: {exc}") from None
        if workers is None:
            continue
        if listed:
            raise ConfigError(f"{where}: {key} {url} is an sglang-router: give it alone as rollout.url (its servers "
                              "become the run's engines), or list servers only in rollout.urls")
        data = copy.deepcopy(recipe.raw)
        data["rollout"].pop("url")
        data["rollout"]["urls"] = list(workers)
        log(f"rollout.url {url} is an sglang-router: its {len(workers)} server(s) are the run's engines, each "
            f"synced and checked ({', '.join(workers)})")
        resolved = parse_recipe(YamlDoc(data, {}, recipe.source))
        return dataclasses.replace(resolved, lines=dict(recipe.lines), overrides=recipe.overrides)
    return recipe

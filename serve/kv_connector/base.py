"""The KV connector seam, vLLM v1's shape (KVConnectorBase_V1): what an engine calls so that K,V can come from, and
go to, somewhere other than its own device pool. One class, two sides, both on every rank:

    scheduler side (host; every rank alike)
        update_connector_output(engine)                            before each iteration is planned: what the
                                                                   transfers finished (a P/D decode side takes the
                                                                   requests whose K,V have landed in here)
        get_num_new_matched_tokens(request, num_computed_tokens)   tokens past the local prefix hit the connector
                                                                   can supply (whole blocks), at admission
        update_state_after_alloc(request, block_ids, num_external_tokens)   the fresh blocks they go into
        block_leaving(key, parent, token_ids, block)                a named block is taken for new tokens (ours:
                                                                   KVCacheManager.grow tells it)
        build_connector_meta(plan)                                 what the worker side does in this plan (it rides
                                                                   in it: SchedulerOutput.kv_connector_metadata)
        request_finished(request, block_ids)                       a request finished, its blocks still intact until
                                                                   the next forward (a P/D prefill side sends then)
    worker side (this rank's pool)
        start_load_kv(metadata)                                    before the forward: begin moving K,V in
        wait_for_layer_load(layer)                                 before layer `layer` reads its cache
        save_kv_layer(layer)                                       after layer `layer` wrote its cache
        wait_for_save()                                            after the forward

`attach(engine)` binds a connector to its engine once: it may keep the engine, and the seam calls
wait_for_layer_load and save_kv_layer around each of the model's layers (forward hooks on its blocks) when the
connector overrides them. Chosen by EngineConfig.kv_transfer_config (serve/kv_connector/config.py). Each method here
does nothing, so a connector overrides only its own.
"""

from __future__ import annotations


class KVConnectorBase:
    engine = None
    _layer_hooks: list = []

    def attach(self, engine) -> None:
        """Bind to `engine` (an LLMEngine): its layers call wait_for_layer_load / save_kv_layer where overridden."""
        self.engine = engine
        blocks, hooks = engine.lm.stack.blocks, []  # layer i: this rank's i-th block, its pool's layer i
        loads, saves = self.per_layer()
        if loads:
            hooks += [b.register_forward_pre_hook(lambda m, a, i=i: self.wait_for_layer_load(i))
                      for i, b in enumerate(blocks)]
        if saves:
            hooks += [b.register_forward_hook(lambda m, a, o, i=i: self.save_kv_layer(i)) for i, b in enumerate(blocks)]
        self._layer_hooks = hooks

    def per_layer(self) -> tuple[bool, bool]:
        """Whether the layers call wait_for_layer_load and save_kv_layer: where this connector overrides them."""
        return overrides(self, "wait_for_layer_load"), overrides(self, "save_kv_layer")

    # -- scheduler side ----------------------------------------------------------------------------------------------

    def update_connector_output(self, engine) -> None:
        pass

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        return 0

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        pass

    def block_leaving(self, key: int, parent: int, token_ids: tuple, block: int) -> None:
        pass

    def build_connector_meta(self, plan):
        return None

    def request_finished(self, request, block_ids: list[int]) -> bool:
        return False

    def has_pending(self) -> bool:
        """Requests this connector will still add to the engine (a P/D decode side's hand-overs to come): a driver
        keeps stepping while it has some. The same on every rank at a step's boundary."""
        return False

    # -- worker side -------------------------------------------------------------------------------------------------

    def start_load_kv(self, metadata) -> None:
        pass

    def wait_for_layer_load(self, layer: int) -> None:
        pass

    def save_kv_layer(self, layer: int) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    # -- both --------------------------------------------------------------------------------------------------------

    def stats(self) -> dict:
        """Counters for LLM.stats() and /metrics (rank 0's)."""
        return {}

    def step_checks(self) -> int:
        """Collectives the scheduler side ran since the step began (the traffic model predicts them)."""
        return 0

    def begin_step(self) -> None:
        pass

    def close(self) -> None:
        for h in self._layer_hooks:
            h.remove()
        self._layer_hooks = []


def overrides(connector: KVConnectorBase, name: str) -> bool:
    return getattr(type(connector), name) is not getattr(KVConnectorBase, name)

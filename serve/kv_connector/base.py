"""The KV connector seam, vLLM v1's shape (KVConnectorBase_V1): what an engine calls so that K,V can come from, and
go to, somewhere other than its own device pool. One class, two sides, both on every rank:

    scheduler side (host; every rank alike, inside Scheduler.schedule)
        get_num_new_matched_tokens(request, num_computed_tokens)   tokens past the local prefix hit the connector
                                                                   can supply (whole blocks)
        update_state_after_alloc(request, block_ids, num_external_tokens)   the fresh blocks they go into
        block_leaving(key, parent, token_ids, block)                a named block is taken for new tokens (ours:
                                                                   KVCacheManager.grow tells it)
        build_connector_meta()                                     what the worker side does this step (it rides in
                                                                   the plan: SchedulerOutput.kv_connector_metadata)
        request_finished(request, block_ids)                       a request finished (True: the connector still
                                                                   reads its blocks; none here does)
    worker side (this rank's pool; serve/model_runner.py)
        start_load_kv(metadata)                                    before the forward: begin moving K,V in
        wait_for_layer_load(layer)                                 before layer `layer` reads its cache
        save_kv_layer(layer)                                       after layer `layer` wrote its cache
        wait_for_save()                                            after the forward

Chosen by EngineConfig.kv_transfer_config (serve/kv_connector/config.py), built by `make_connector`. Each method
here does nothing, so a connector overrides only its own.
"""

from __future__ import annotations


class KVConnectorBase:
    # -- scheduler side ----------------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        return 0

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        pass

    def block_leaving(self, key: int, parent: int, token_ids: tuple, block: int) -> None:
        pass

    def build_connector_meta(self):
        return None

    def request_finished(self, request, block_ids: list[int]) -> bool:
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
        pass

"""A KV connector that does nothing: measures what vLLM's connector machinery itself costs
per step, so ulacache's overhead over stock can be attributed (capacity benchmark)."""
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)


class _Meta(KVConnectorMetadata):
    pass


class NoopConnector(KVConnectorBase_V1, SupportsHMA):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        return None

    def build_connector_meta(self, scheduler_output):
        return _Meta()

    def request_finished(self, request, block_ids):
        return False, None

    def request_finished_all_groups(self, request, block_ids):
        return False, None

    def start_load_kv(self, forward_context, **kwargs):
        return None

    def wait_for_layer_load(self, layer_name):
        return None

    def save_kv_layer(self, *args, **kwargs):
        return None

    def wait_for_save(self):
        return None

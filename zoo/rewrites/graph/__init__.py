"""ExportedProgram surgery shared by every zoo rewrite, in one place: naming and finding nodes and declining
(``nodes``), fake values (``values``), and building the rewritten program (``programs``). Rewrites import it
from here."""

from __future__ import annotations

from zoo.rewrites.graph.nodes import (Declined, aten, calls, decline_on_failure, fetch_attr, getitem_users,
                                      graph_modules_under, hop_bodies, input_nodes, is_hop, is_inference_program,
                                      node_label, op_name, require_program, rewriting, schema_get, schema_set,
                                      written_args)
from zoo.rewrites.graph.programs import (GraphBuilder, copy_program, finish, private_copy, rebuild_program,
                                         replace_state, state_location, state_tensor, state_writer)
from zoo.rewrites.graph.values import (PROVENANCE_KEYS, VALUE_META_KEYS, fake_eval, fake_mode_of,
                                       inherit_provenance, insert_call, no_autocast, node_value, same_dtypes,
                                       same_layout, same_size, same_tensor_meta, same_value_meta, set_value,
                                       tensors_in)

__all__ = [
    "Declined", "aten", "calls", "decline_on_failure", "fetch_attr", "getitem_users", "graph_modules_under",
    "hop_bodies", "input_nodes", "is_hop", "is_inference_program", "node_label", "op_name", "require_program",
    "rewriting", "schema_get", "schema_set", "written_args",
    "GraphBuilder", "copy_program", "finish", "private_copy", "rebuild_program", "replace_state", "state_location",
    "state_tensor", "state_writer",
    "PROVENANCE_KEYS", "VALUE_META_KEYS", "fake_eval", "fake_mode_of", "inherit_provenance", "insert_call",
    "no_autocast", "node_value", "same_dtypes", "same_layout", "same_size", "same_tensor_meta", "same_value_meta",
    "set_value", "tensors_in",
]

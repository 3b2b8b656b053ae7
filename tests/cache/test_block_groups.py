"""`plan_groups`: block groups, pools and slots, with exact ids."""

from kvabi.abi.descriptor import ATTN, NONE, SHARED, LayerSpec, ModelSpec
from kvabi.cache.block_groups import BlockGroup, plan_groups

FULL = LayerSpec(ATTN, 1, 8, 8)
SLIDING = LayerSpec(ATTN, 1, 8, 8, window=16)
WIDE = LayerSpec(ATTN, 2, 16, 16)


def test_a_uniform_model_is_one_group_over_its_own_descriptor():
    model = ModelSpec((FULL,) * 3, "m")
    plan = plan_groups(model)
    assert plan.groups == (BlockGroup(0, (0, 1, 2), 0, 0),) and plan.is_uniform
    assert plan.pool_specs == (model,)
    assert plan.layer_slots == ((0, 0), (0, 1), (0, 2))


def test_gemma3_like_layers_split_into_equal_groups_over_one_pool():
    layers = tuple(FULL if i % 3 == 2 else SLIDING for i in range(6))  # 4 sliding, 2 full
    plan = plan_groups(ModelSpec(layers, "m"))
    assert plan.groups == (
        BlockGroup(0, (0, 1), 16, 0),
        BlockGroup(1, (3, 4), 16, 0),
        BlockGroup(2, (2, 5), 0, 0),
    )
    assert plan.pool_specs == (ModelSpec((FULL, FULL), "m"),)  # two slots, windows dropped
    assert plan.layer_slots[3] == (1, 0) and plan.layer_slots[5] == (2, 1)


def test_geometries_get_pools_and_shared_or_kvless_layers_get_no_slot_of_their_own():
    layers = (SLIDING, WIDE, LayerSpec(SHARED, shares=0, window=16), LayerSpec(NONE), WIDE)
    plan = plan_groups(ModelSpec(layers, "m"))
    assert plan.groups == (BlockGroup(0, (0,), 16, 0), BlockGroup(1, (1, 4), 0, 1))
    assert plan.pool_specs == (ModelSpec((FULL,), "m"), ModelSpec((WIDE, WIDE), "m"))
    assert plan.layer_slots == ((0, 0), (1, 0), (0, 0), (-1, -1), (1, 1))


def test_one_kind_with_a_shared_layer_stores_only_the_owners():
    plan = plan_groups(ModelSpec((FULL, FULL, LayerSpec(SHARED, shares=1)), "m"))
    assert plan.groups == (BlockGroup(0, (0, 1), 0, 0),)
    assert plan.pool_specs == (ModelSpec((FULL, FULL), "m"),)  # not the model: no shared slot
    assert plan.layer_slots == ((0, 0), (0, 1), (0, 1))

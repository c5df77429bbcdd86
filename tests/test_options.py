"""options.py is a leaf of the package: what it validates against is declared there, and must stay
what the rest of optpass registers."""

import dataclasses

from optpass import options, passes
from optpass.passes import shard_optimizer


def test_the_pass_names_options_validates_are_the_pipelines_in_its_order():
    assert options.PASS_NAMES == tuple(p.name for p in passes.PASSES)


def test_the_collective_plans_options_validates_are_the_ones_shard_optimizer_runs():
    assert shard_optimizer.PLANS is options.COLLECTIVE_PLANS
    assert {"reduce_scatter", "all_reduce"} <= set(options.COLLECTIVE_PLANS)


def test_every_option_is_a_field_of_options_with_the_default_it_declares():
    fields = {f.name: f.default for f in dataclasses.fields(options.Options)}
    assert fields == {o.name: o.default for o in options.OPTIONS}

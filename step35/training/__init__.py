"""How step35 trains, in three rooms: `setup` (the model fit trains and plan counts: built, adapted,
sharded, frozen, filled), `optimizer` (param groups, the optimizer, its schedule, what a resume may
change) and `objective` (what a micro-batch's loss is and how a step's losses are reduced)."""

"""How a model splits across tensor-parallel ranks, below the model code that uses it:
`sharding` (which dimension of each weight splits, and each rank's share) and `group` (a rank's
view of its peers for the model's collectives; a group of one is a no-op). Starting ranks and
carrying steps between them is `fastgen.distributed`, above the engine's runner."""

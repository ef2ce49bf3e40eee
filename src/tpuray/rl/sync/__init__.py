"""Weight sync straight from a `tpuray.train` run into a `RolloutEngine`'s workers (issue 23, item 2):
the update message (`update`), the trainer's side (`trainer.SyncTarget`), the driver's
(`driver.WeightSync`), the mailbox between them (`mailbox`), the transports (`collective`: tpu_dist;
`handover`: colocated, in process) and what a process keeps between syncs (`local`).


Every trainer rank cuts, from the tensors it holds, the part each rollout tensor-parallel rank needs
(`tpuray.rl.weights.cut`).
Transport "object_store": it puts one object per rollout rank in Ray's object store; only the ObjectRefs
travel through a small mailbox actor to the driver, which hands them to the engine: rollout rank r pulls
the pieces addressed to it from every trainer rank, checks and assembles them, and stages its fused
shards (the engine's all-or-nothing stage / commit). Transport "tpu_dist" (`collective`): only
the pieces' metadata travels through the mailbox; the trainer ranks send the data at once over a process
group spanning both sides, and rollout rank r receives it when the driver hands it the metadata, then
checks, assembles and stages as above. No full copy of the state on the driver. Colocated over
"tpu_dist" (the engine's ranks are the trainer's processes), each rank builds its own engine rank's
shards over the trainer's group and leaves them in its process (`handover`): only a marker
passes the mailbox.

- sharded trainer (FSDP2 / DTensor with `Shard(0)` on a 1-D mesh): every rank sends the rows it holds;
- replicated trainer (DDP, or one worker): rank 0 sends the full state, the other ranks nothing.

On the trainer (in the train loop):      `target.send(model, version)`  (every rank; blocks until the
                                          engine committed the update, so the objects' owner outlives it)
On the driver:                            `sync = WeightSync(tp, trainer_world_size, transport=...)`,
                                          `update = sync.receive(alive)` (its `version`),
                                          `engine.update_weights(update)`, `sync.ack(update)`
                                          (or `sync.ack(update, error)` when it was refused).

Trainer restarts (`tpuray.train` fault tolerance, docs/rl.md "Trainer restarts"): the weight keys carry the
trainer attempt (`TrainContext.get_attempt()`); the mailbox forgets an older attempt's entries once a
newer one sends, `receive` returns the newest attempt's first complete update (a restarted trainer
re-sends the versions after its checkpoint), and batches stay in the mailbox so that a restarted rank
can take batch k again. Over "tpu_dist" each attempt forms its own group with the engine's workers
(`Channel.generation`). Colocated, a rank says where it waits (`ready` keys, with its actor handle, where
the next engine starts after a restart); over "object_store" its pieces are handed to the mailbox,
which owns them (`Mailbox.hand_over`): the last update outlives a lost attempt; over "tpu_dist" the
update lives only in its senders' processes (`handover`).

Rollout restarts (docs/rl.md "Rollout restarts"): over "object_store" the driver reloads the last
update's ObjectRefs into the new engine. Over "tpu_dist" the new engine is a new incarnation
(`Channel.engine`, its own group) and `WeightSync.replace_engine` asks every rank to send its last update
(kept in its process's `LocalSync`) again into it; the rank does so wherever it waits (`SyncTarget._wait`, and
before its group formed, `_offer`).
"""

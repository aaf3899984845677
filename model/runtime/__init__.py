"""The run's machinery: what keeps a training run alive, exact and measured around the model.

  distributed  hosts: jax.distributed, compile cache, preemption flag, gathers over hosts
  checkpoint   Orbax checkpoints: model, optimizer and data-iterator state; damaged steps
  local_tier   a fast per-host checkpoint tier beside the durable one
  resume       where a start begins: which tier and step, what the saved data position is worth
  rollback     divergence found and rolled back to the newest checkpoint before it
  watchdog     hung hosts: stacks written, every process exits and restarts
  goodput      the run's event log and its goodput summary
  meters       what the loop measures (interval meter), the metrics logger and the profiler
"""

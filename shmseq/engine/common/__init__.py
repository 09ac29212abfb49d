"""What the trainer's side and the workers' side share: the messages and how they cross, the
bytes of a slot, the ring's memory, the typed errors."""

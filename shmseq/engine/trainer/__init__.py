"""What runs in the training process: the plan, the pool of workers seen from the consumer, the
slot ring's state machine, the route from slot to device, and the pipeline that wires them."""

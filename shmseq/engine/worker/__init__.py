"""What runs inside a worker (a process or a thread): its loop, and one batch built and written
into its slot."""

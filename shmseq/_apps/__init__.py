"""What the applications (``shmseq.bench``, ``shmseq.demo``) share, so that neither imports
the other: ``load`` (was the machine busy while they measured?), ``report`` (the machine
they measured on, a figure with its spread) and ``data`` (their synthetic images' class
shapes, and data sets written once).
"""

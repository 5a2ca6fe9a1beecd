"""Drivers own the tuning loop: the budget, the storage of results, resume and the progress display.
`sweep.Sweep` holds what any driver shares (history, pruning, recording); `local` runs trials one at a
time on this machine."""

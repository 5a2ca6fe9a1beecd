"""Values: what crosses module lines, frozen and validated when made. A config's knobs (config), the space of
configs (space), what is trained (workload, shapes, models), the devices it runs on (hardware), byte sizes
(units), a sweep's settings (settings), one trial's record (results), and the parsers of typed-in values
(argtypes). Nothing here runs a trial or searches."""

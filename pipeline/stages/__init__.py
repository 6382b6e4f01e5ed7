"""The six stages (generate, cache, train, calibrate, export, evaluate), each a ``run_<stage>(RunConfig)``,
and what only they use (the online feature stream, the export format contract)."""

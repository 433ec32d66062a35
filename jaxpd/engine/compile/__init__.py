"""Getting programs compiled: warm-up's list of serving programs, executables kept on
disk between starts, and compiles on a background thread while the engine serves."""

"""Scripts the tests run as child processes (a fresh process's memory, a SIGKILL at a chosen call);
importable too, for the constants a test shares with its child."""

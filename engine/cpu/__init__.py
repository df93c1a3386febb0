"""How a CPU engine computes: the packed linear layers (`linear`), the cores and intra-op threads
its process runs on (`threads`), and the governor that lowers the thread count while other
processes hold the cores (`thread_governor`). It imports torch and nothing else of pdserve; models
and the engine import it."""

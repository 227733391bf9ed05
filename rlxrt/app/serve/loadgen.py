def add_bench_serve(add, model_flags):
    pass

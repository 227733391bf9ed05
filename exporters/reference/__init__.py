"""The recipe of rlxrt's shipped reference pair: a small Llama target and a distilled draft,
trained on the Python standard library that ships with the interpreter.

    python -m rlxrt.exporters.reference.corpus     WORK   # split + tokenizer
    python -m rlxrt.exporters.reference.train target WORK --steps N
    python -m rlxrt.exporters.reference.train draft  WORK --steps N   # distils from the target
    python -m rlxrt.app.recipe WORK                                    # export + install into rlxrt/assets
    python -m rlxrt.app.recipe WORK --mtp                              # train-head: the target's MTP head

See docs/reference-pair.md for seeds, sizes and timings.
"""

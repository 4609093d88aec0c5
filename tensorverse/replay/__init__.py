"""Replay: scrub recorded sessions into a corpus of test cases, rerun them on any rig, report.

``scrub``       the scrubber (consistent, format-preserving placeholders)
``tokenizers``  re-tokenizing scrubbed text (a local HF tokenizer or a vLLM server)
``corpus``      the corpus format (``corpus.json`` + ``cases/*.json``, JSON Schemas in ``schema/``)
                and ``tensorverse scrub``
``options``     what a replay is asked to do (`ReplayOptions`, ``--backend NAME=URL``)
``runner``      ``tensorverse replay``: cases through the shadow runner
``journal``     the resume journal (``RESULTS.partial.jsonl``)
``rig``         where it ran: the host and each backend as ``doctor`` sees it
``batch_noise`` ``tensorverse noise``: one backend's batch-noise floor
``ray_task``    a whole replay as one Ray task (``--executor ray``)
``report``      results file, summary table, ``--fail-on`` gates, ``report merge``
``html``        the HTML report: an index and the viewer's multiverse page of each diverging case
``tools``       tool simulators for diverged multi-turn branches
``sample``      the generator of the sample corpus (``corpus/netops-sample/``)
"""

"""Our ComfyUI nodes defined once (:mod:`.nodes`), and running workflows without the editor
(:mod:`.run`, behind ``seedvr2 run-workflow``); the package's map: docs/development.md. Importing
it is cheap: nothing here imports torch, PyAV or the models at import time."""

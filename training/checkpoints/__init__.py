"""Resumable checkpoints and `final/`. A checkpoint (`checkpoints/step_N`) holds the model and optimizer state in one
format for every strategy and process count (`model_state/`: tensors.py), accelerate's `save_state` of the rest
(schedule, RNG, data position), the parts' own files (`Part.save_state`: a stream's position, PowerSGD's state),
`manifest.json` (every file and its size, checked before a resume) and `trainer_state.json` (files.py). Each is saved
to `step_N.tmp` and renamed once every rank is done (a killed save never counts: save.py); multi-node needs a shared
filesystem. A checkpoint belongs to one run (`run_id`, kept across resumes): a resume (resume.py) never mixes its
checkpoints with another run's."""

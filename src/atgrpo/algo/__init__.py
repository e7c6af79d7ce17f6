"""The algorithm the paper specifies: records, tree and independent rollouts, group-normalised
advantages, the PPO-clip loss, prefix-shared forwards and one policy's update.

Nothing here reads :class:`atgrpo.config.Config`: every function takes plain values or the
settings records that :mod:`atgrpo.training.settings` builds from the config once per run.
"""

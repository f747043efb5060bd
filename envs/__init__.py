"""Environments behind one id scheme."""

from plasticity_zoo.envs.make import ID_FORMS, VectorEnv, make_env, make_vector_env

__all__ = ["ID_FORMS", "VectorEnv", "make_env", "make_vector_env"]

"""The performance model: one small estimator per term, each a pure function of measurements."""

from tula_service.perfmodel.compute import ComputeModel
from tula_service.perfmodel.efficiency import EpochModel, NoiseScaleModel
from tula_service.perfmodel.memory import MemoryModel
from tula_service.perfmodel.network import RingAllReduce

__all__ = ["ComputeModel", "EpochModel", "MemoryModel", "NoiseScaleModel", "RingAllReduce"]

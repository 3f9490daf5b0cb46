"""The performance model: one small estimator per term, each a pure function of measurements."""

from tula_service.fit.perfmodel.compute import ComputeModel
from tula_service.fit.perfmodel.efficiency import EpochModel, NoiseScaleModel
from tula_service.fit.perfmodel.memory import MemoryModel
from tula_service.fit.perfmodel.network import RingAllReduce

__all__ = ["ComputeModel", "EpochModel", "MemoryModel", "NoiseScaleModel", "RingAllReduce"]

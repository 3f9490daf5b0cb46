// The fitted models as the API reports them (recommendation.models), evaluated for drawing.
// Each function mirrors one formula of tula_service.perfmodel, named in the API's `formula` field;
// tests/test_dashboard.py checks them against the Python models.

// T_comp(b), seconds, for each shape of tula_service/perfmodel/compute.py
export const COMPUTE_SHAPES = {
  linear: (p, b) => p.alpha_s + p.beta_s_per_sample * b,
  saturating: (p, b) => p.alpha_s + p.beta_s_per_sample * Math.max(b, p.saturation_batch),
  power: (p, b) => p.alpha_s + p.beta_s * b ** p.exponent,
};

// compute = {name, params} (models.compute, or one of models.compute.selection.candidates)
export function computeTimeS(compute, deviceBatches) {
  const shape = COMPUTE_SHAPES[compute.name];
  if (!shape) return null; // a shape this dashboard does not know: draw no curve rather than a wrong one
  return deviceBatches.map((b) => shape(compute.params, b));
}

// M(b) = static_bytes + act_bytes_per_sample * b
export function memoryBytes(memory, deviceBatches) {
  return deviceBatches.map((b) => memory.static_bytes + memory.act_bytes_per_sample * b);
}

// E(B) = E_min (1 + B / B_noise) with a fitted noise scale, never below E_ref B / (B_ref g) when the spec
// gives max_lr (g = max_step_gain), else E_ref max(1, B / B_ref) (assumed); perfmodel/efficiency.py
export function epochs(efficiency, training, globalBatches) {
  if (efficiency.noise_scale) {
    const minEpochs = efficiency.min_epochs.value;
    const noiseScale = efficiency.noise_scale.value;
    const gain = efficiency.max_step_gain ? efficiency.max_step_gain.value : null;
    return globalBatches.map((B) => {
      const noiseBound = minEpochs * (1 + B / noiseScale);
      return gain ? Math.max(noiseBound, (training.reference_epochs * B) / (training.reference_batch * gain)) : noiseBound;
    });
  }
  return globalBatches.map((B) => training.reference_epochs * Math.max(1, B / training.reference_batch));
}

// n points spaced evenly in log2 between low and high (inclusive)
export function logGrid(low, high, n = 80) {
  const a = Math.log2(low);
  const b = Math.log2(high);
  return Array.from({ length: n }, (_, i) => 2 ** (a + ((b - a) * i) / (n - 1)));
}

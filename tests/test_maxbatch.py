from tula_service.dispatch.maxbatch import bracket, next_probe


def test_no_out_of_memory_means_no_search():
    assert next_probe([8, 16, 32], [], predicted_max=500, probes_done=0, max_probes=4) is None


def test_first_probe_is_the_memory_models_prediction_inside_the_bracket():
    assert next_probe([8, 16, 32], [64], predicted_max=50, probes_done=0, max_probes=4) == 50


def test_prediction_outside_the_bracket_falls_back_to_bisection():
    assert next_probe([8, 16, 32], [64], predicted_max=500, probes_done=0, max_probes=4) == 48


def test_later_probes_bisect_the_bracket():
    # the prediction 50 ran out of memory: now bisect between 32 and 50
    assert next_probe([8, 16, 32], [50, 64], predicted_max=50, probes_done=1, max_probes=4) == 41


def test_search_stops_when_the_bracket_is_tight_or_the_budget_is_spent():
    assert next_probe([8, 16, 32, 48], [50], predicted_max=None, probes_done=2, max_probes=4) is None
    assert next_probe([8], [1024], predicted_max=None, probes_done=4, max_probes=4) is None


def test_everything_out_of_memory_searches_below_the_smallest():
    assert bracket([], [8]) == (0, 8)
    assert next_probe([], [8], predicted_max=None, probes_done=0, max_probes=4) == 4


def test_search_converges_to_a_hidden_limit_within_tolerance():
    limit = 777  # batches above it run out of memory
    ok, oom, probes = [64, 128, 256, 512], [1024], 0
    while (probe := next_probe(ok, oom, predicted_max=700, probes_done=probes, max_probes=12)) is not None:
        (ok if probe <= limit else oom).append(probe)
        probes += 1
    largest_ok, smallest_oom = bracket(ok, oom)
    assert largest_ok <= limit < smallest_oom
    assert smallest_oom - largest_ok <= max(1, int(0.05 * largest_ok))
    assert probes <= 7


def test_a_wide_bracket_is_bisected_geometrically():
    # 8 ran, 2^30 did not: the next probe is sqrt(8 * 2^30) = 92 681, not 2^29
    assert next_probe([8], [2**30], predicted_max=None, probes_done=1, max_probes=4) == 92_681


def test_a_wide_bracket_comes_within_a_factor_of_two_in_few_probes():
    limit = 3000
    ok, oom, probes = [8], [2**30], 0
    while bracket(ok, oom)[1] > 2 * bracket(ok, oom)[0]:
        probe = next_probe(ok, oom, predicted_max=None, probes_done=probes, max_probes=32)
        (ok if probe <= limit else oom).append(probe)
        probes += 1
    assert probes <= 6

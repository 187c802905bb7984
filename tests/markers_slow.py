"""The tests `make test` leaves out: the `slow` marker, in one list.

`make test` (the fast loop) runs `-m "not slow"`; `make test-slow` runs
exactly these, and `make test-thorough` and `.ci/run` run both, so every
property stays checked on every merge. tests/conftest.py adds the marker to
each test named here, and only to those (this list is the one place that
says a test is slow: no `@pytest.mark.slow` in the test files);
tests/test_markers.py fails when an entry names no test.

An entry is `file::test` (every parametrization) or `file::test[id]` (that
one), with the path relative to tests/, and says why the test is slow: the
CPU seconds it took on the 2-core machine (`--durations`, ranked; shared
machines are noisy) and what makes it cost that much (a subprocess, an XLA
compile, a `fit`, g++). Put a test here only when it cannot be made cheap
without losing what it checks, and keep a cheaper sibling in the fast loop
where one can cover the same code.

    >>> slow_reason("test_cudnn_op_build.py::test_two_processes_build_once")[:13]
    'two processes'
    >>> slow_reason("test_cache.py::test_two_writer_processes_lose_no_entry") is None
    True
"""

from __future__ import annotations

SLOW: dict[str, str] = {
    # -- subprocesses: each imports TensorFlow (and Keras) again ---------------
    "test_cli.py::test_python_m_rnnfuse_subprocesses": "two `python -m rnnfuse` processes, TF and torch (20 s wall)",
    "test_cudnn_op_build.py::test_the_op_compiles_here_and_registers_both_ops": "g++ builds the op (17 s wall)",
    "test_cudnn_op_build.py::test_two_processes_build_once": "two processes, one g++ build (13 s wall)",
    "test_cudnn_op_build.py::test_import_and_cpu_use_never_build": "a fresh process (9 s wall)",
    "test_cudnn_core_build.py::test_the_core_compiles_here_links_no_cuda_and_errs_cleanly_without_a_driver": (
        "g++ builds the cuDNN core (5 s wall)"
    ),
    # Their module fixture `built` runs nvcc and g++ on the wavefront kernel
    # (16 s wall), paid only when one of them runs; the fake-compiler tests
    # of the build's cache and errors stay fast.
    **{
        f"test_wavefront_build.py::{name}": "uses the `built` library (nvcc + g++, 16 s wall, shared)"
        for name in (
            "test_the_library_compiles_here_without_a_cuda_runtime",
            "test_the_headline_stack_fits_an_h200",
            "test_refused_shapes_say_why",
            "test_a_smaller_device_fits_fewer_layers",
            "test_stacks_larger_than_the_chip_run_as_segments_that_fit_an_h200",
            "test_a_stack_whose_one_layer_does_not_fit_has_no_segments",
            "test_the_bidirectional_entries_are_declared_as_the_host_defines_them",
            "test_a_bidirectional_layers_directions_plan_as_independent_first_layers",
            "test_workspace_holds_the_flags_and_the_sequences_below_the_top",
            "test_a_call_without_a_driver_or_a_bad_argument_is_a_clear_error",
            "test_the_tensorflow_op_compiles_and_registers",
            "test_the_training_ops_register_with_the_kernels_layouts",
            "test_the_training_wrappers_bind_to_the_ops_signatures",
        )
    },
    # The compiled cubin (nvcc, 25 s of a core): the fast loop checks the
    # kernels' names in the sources (test_wavefront_build.py::
    # test_every_kernel_the_host_loads_is_one_the_cubin_source_defines).
    "test_wavefront_variant.py::test_the_cubin_carries_the_variant_kernels": (
        "reads the nvcc-built cubin (`built_wavefront`, 25 s of a core, shared)"
    ),
    "test_wavefront_wgmma_layout.py::test_the_cubin_carries_variant_twos_kernels": (
        "reads the nvcc-built cubin (`built_wavefront`, 25 s of a core, shared)"
    ),
    # nvcc to PTX (15 s of a core, once a module): the forward kernels' waits and fences
    **{f"test_wavefront_ptx.py::{name}": "compiles the kernel to PTX (nvcc, 15 s of a core, shared)"
       for name in ("test_a_forward_that_publishes_its_steps_waits_for_its_inputs",
                    "test_variant_three_waits_in_the_data_not_on_flags",
                    "test_variant_two_orders_its_copies_and_its_products",
                    "test_variant_two_waits_as_variant_zero_does",
                    "test_variant_four_waits_on_its_copies_not_on_a_proxy_fence",
                    "test_variant_four_waits_for_its_flags_as_variant_zero_does")},
    # -- fits long enough for the tuning budget: TensorFlow traces per fit -----
    "test_budget.py::test_a_decision_cut_short_is_not_cached_and_a_full_one_is": (
        "three optimized fits, each traced (24 s); test_call_steps and the spend tests stay fast"
    ),
    "test_budget.py::test_a_short_fit_times_less_than_a_long_one": "three optimized fits (18 s)",
    "test_budget.py::test_the_budget_scales_with_the_original_layers_step": "two optimized fits (14 s)",
    "test_bench_online_agreement.py::test_online_tuning_that_keeps_the_original_layers_agrees": (
        "an online fit racing its candidates on the emulated op (5.5 s); the judging tests stay fast"
    ),
    "test_online.py::test_the_candidates_race_as_traced_training_steps_and_the_fastest_is_committed": (
        "a traced step per candidate (14 s); torch's online tests stay fast"
    ),
    "test_wavefront_wiring.py::test_predict_and_fit_each_run_their_own_decision[lstm]": "predict and fit with tuning (6.5 s)",
    "test_wavefront_wiring.py::test_predict_and_fit_each_run_their_own_decision[gru]": "as [lstm]",
    "test_wavefront_wiring.py::test_a_step_whose_kernel_falls_back_is_not_timed": "tuner steps (5 s)",
    "test_wavefront_wiring.py::test_gradients_through_an_inference_call_are_cudnns[True-lstm]": (
        "traced gradients (5.6 s); the [False-*] cases stay fast"
    ),
    "test_wavefront_wiring.py::test_gradients_through_an_inference_call_are_cudnns[True-gru]": "as [True-lstm] (4.4 s)",
    "test_distribute.py::test_mirrored_fit_trains_the_same_variables_on_every_replica": (
        "a process with two logical CPU devices, fit under MirroredStrategy (25 s wall)"
    ),
    "test_examples.py::test_text_classifier_script_runs": "runs the example script in a process (16 s wall)",
    "test_markers.py::test_the_slow_marker_selects_exactly_the_listed_tests": "collects tests/ in a process (12 s wall)",
    "test_persistence.py::test_a_restored_model_holding_projected_lstm_needs_rnnfuse_imported": (
        "loads the file in a fresh process (16 s wall)"
    ),
    # Their module fixture `elsewhere` runs every job in one fresh process
    # without rnnfuse (39 s wall), paid only when one of them runs.
    **{
        f"test_persistence.py::{name}": "reads the `elsewhere` process's results (39 s wall, shared)"
        for name in (
            "test_a_saved_model_loads_trains_on_and_keeps_its_optimizer_without_rnnfuse",
            "test_every_model_checkpoint_file_loads_without_rnnfuse",
            "test_without_rnnfuse_a_fused_format_file_says_it_needs_rnnfuse",
            "test_export_is_the_original_models_saved_model_and_serves_without_rnnfuse",
            "test_onnx_export_is_the_original_models_and_runs_in_onnxruntime",
        )
    },
    "test_persistence.py::test_rnnfuse_load_model_fuses_again_and_resumes_training[fused_format]": (
        "save, load and fit (11 s wall); [portable] stays fast"
    ),
    "torch_backend/test_ddp.py::test_ddp_two_processes_match_the_original_and_every_replica_fuses": (
        "torchrun, two processes (28 s wall)"
    ),
    "torch_backend/test_torch_threads_and_precision.py::test_a_bad_rnnfuse_torch_calls_warns_and_import_rnnfuse_still_works": (
        "import rnnfuse in a fresh process (10 s wall); test_rnnfuse_torch_calls_sets_the_process_default stays fast"
    ),
    # -- torch.compile: dynamo traces Keras' unrolled loops and training steps --
    "torch_backend/test_torch_compile.py::test_a_jit_compiled_model_with_states_and_a_bidirectional_stack_trains_as_the_unfused": (
        "two models compiled for fit, predict and evaluate (66 s)"
    ),
    "torch_backend/test_torch_compile.py::test_a_jit_compiled_masked_model_with_dropout_between_layers_matches_the_unfused": (
        "two models compiled for predict and evaluate, one for fit (43 s)"
    ),
    **{
        f"torch_backend/test_torch_compile.py::test_the_fused_call_compiles_whole_and_matches_the_eager_call[{case}]": (
            "two compiles of a fused call (3-7 s); [lstm-core] and [gru-torch_vf] stay fast"
        )
        for case in ("gru-core", "bigru-core", "bigru-torch_vf", "lstm-torch_vf")
    },
    "torch_backend/test_torch_kept_original.py::test_a_kept_original_group_dispatches_the_original_modelstorch_ops[bidirectional_lstm]": (
        "profiles four entry points of two models (5 s); [gru] and the mixed_float16 BiLSTM stay fast"
    ),
    "torch_backend/test_torch_compile.py::test_a_wavefront_inference_call_compiles_whole": (
        "a compile of a float16 call (4 s); tests/gpu/test_gpu_torch_compile.py runs the kernel"
    ),
    "torch_backend/test_torch_compile.py::test_a_masked_call_compiles_exactly_with_a_break_for_the_hosts_lengths": (
        "a compile in three graphs (6 s)"
    ),
    # -- fit, several models, or a real tuner run (CPU seconds) ----------------
    "test_wavefront_training_tf.py::test_the_gradient_is_the_same_inside_a_tf_function": (
        "traces the emulated kernels' training step in a tf.function (25-60 s); the eager gradient tests stay fast"
    ),
    "test_custom_loop_plans.py::test_after_an_online_race_a_custom_loop_runs_the_committed_plan": (
        "a raced fit, then a traced custom loop (25-54 s); test_online.py's races and the decided-fit loop stay fast"
    ),
    "test_bench_user_view.py::test_a_lopsided_cell_runs_a_short_custom_loop": (
        "a cell's fits and custom loop (12-26 s); the bench's other tests stay fast"
    ),
    "test_first_batch.py::test_a_plan_its_default_twin_and_the_reference_share_one_program": (
        "a tuned fit building the shared check program (7-13 s); the failing shared program's test stays fast"
    ),
    "test_first_batch.py::test_a_masked_fused_candidate_is_timed_with_its_branch_for_other_masks": (
        "a masked tuned fit (5-9 s); the padding-mask test stays fast"
    ),
    "test_per_shape.py::test_timing_from_inside_a_custom_training_loop_trace_times_training_steps": (
        "a traced custom loop timing its candidates (7-12 s); the loop-after-fit tests stay fast"
    ),
    "test_wavefront_lamport.py::test_the_sentinel_check_finds_a_sentinel_half_exactly": (
        "the bit check over a grid of 32-bit words (6-11 s); the stored-value tests stay fast"
    ),
    "test_online_algorithm.py::test_without_a_runtime_algorithm_each_candidate_traces_its_own_step": (
        "a race tracing a step per candidate (11-24 s); the shared-trace race stays fast"
    ),
    "test_activity_regularizers.py::test_activity_losses_and_training_match_the_original[masked]": (
        "evaluate and a fit epoch of two models (12 s); [issue_repro] stays fast"
    ),
    "test_activity_regularizers.py::test_activity_losses_and_training_match_the_original[bidirectional]": "as [masked] (14 s)",
    "test_activity_regularizers.py::test_activity_losses_and_training_match_the_original[states]": "as [masked] (7 s)",
    "test_activity_regularizers.py::test_activity_losses_and_training_match_the_original[last_layer]": "as [masked] (7 s)",
    "test_activity_regularizers.py::test_activity_losses_and_training_match_the_original[rnn_cell_middle]": "as [masked] (5 s)",
    "test_tuning_stages.py::test_both_stages_run_real_steps_and_build_each_plan_once": "the tuner's real steps (13 s)",
    "test_first_batch.py::test_first_fit_times_the_candidates_on_the_real_batch_and_keeps_the_fastest": (
        "a fit that times every candidate (11 s); the faked-timer tests stay fast"
    ),
    "test_first_batch.py::test_a_masked_input_is_timed_with_a_mask_and_cached_as_its_own_decision": "two fits (6 s)",
    "test_first_batch.py::test_mask_is_right_padded_leaves_the_per_layer_fallback_untraced": "traces (4 s)",
    "test_first_batch.py::test_a_shape_already_decided_reads_no_cache_file_again": "four fits (3 s)",
    "test_first_batch.py::test_a_half_precision_check_computes_the_twin_only_over_the_rounding_floor": (
        "the float64 reference traced through the emulated op (4-8 s); test_tuning's property test "
        "of the rule stays fast"
    ),
    "test_persistence.py::test_weights_files_carry_the_optimizer_state_both_ways": "fits and reloads, both ways (16 s)",
    "test_persistence.py::test_model_checkpoint_weights_only_resumes_the_original": "fits with a checkpoint (4 s)",
    "test_cudnn_op_wrapper.py::test_the_tuner_builds_one_step_per_piece_set_where_the_backend_shares": (
        "builds and times every piece set (5 s)"
    ),
    "test_bench_user_view.py::test_rounds_are_sized_from_the_step_not_from_a_whole_fit_call": "fits (6 s)",
    "test_bench_single_layers.py::test_a_seq2seq_cell_times_both_models_interleaved_as_groups_of_one": (
        "fits both models in interleaved rounds (9 s)"
    ),
    "test_single_layers.py::test_first_batch_tuning_decides_each_group_of_one[fused_wins]": (
        "a fit that switches two groups to their fused call and traces it (13 s); "
        "[within_the_margin] stays fast"
    ),
    "test_api.py::test_training_the_optimized_model_trains_the_original": (
        "two fits (4 s); test_training.py's fit/evaluate/predict test stays fast"
    ),
    "test_activity_regularizers.py::test_activity_losses_and_training_match_the_original[issue_repro]": (
        "as [masked] (6 s); the torch cases (0.3 s each) and the masked-loss test keep the property fast"
    ),
    "test_first_batch.py::test_timing_that_fails_runs_the_static_tables_proven_plan": "a fit (4 s)",
    "test_first_batch.py::test_a_corrupt_cache_file_is_set_aside_and_tuning_goes_on": "a fit (3 s); test_cache.py checks the file",
    "test_first_batch.py::test_a_new_bucket_is_timed_on_its_contenders_and_a_shape_of_a_decided_bucket_is_not": (
        "fits at three shapes (3 s); test_per_shape.py times a new bucket in the fast loop"
    ),
    "test_per_shape.py::test_a_plan_is_never_switched_mid_epoch": (
        "two fit epochs (5 s); the fast loop times a new bucket through predict"
    ),
    "test_per_shape.py::test_a_custom_loop_trace_gets_a_plan_timed_for_its_shape": (
        "a training trace and three inference traces (5 s); the fast loop times from inside "
        "one trace (test_timing_from_inside_a_custom_loop_trace_...)"
    ),
    "test_persistence.py::test_rnnfuse_load_model_fuses_again_and_resumes_training": (
        "save, load and fit (6 s a case); test_a_file_in_the_fused_format_of_0_1_0_still_loads stays fast"
    ),
    "test_persistence.py::test_save_writes_exactly_the_original_models_file[functional]": "fit and save (5 s); [sequential] stays fast",
    "test_training.py::test_without_a_gpu_jit_compile_true_just_works": "a jit-compiled fit (2 s)",
    "test_cli.py::test_bench_json_train_and_mixed_precision": (
        "rebuilds under mixed_float16 and times training (3 s); test_bench_prints_device_medians_and_ratio stays fast"
    ),
    "test_projected_lstm.py::test_output_keeps_its_static_time_dimension_for_an_unrolled_layer_after_it": "a fit (3 s)",
    "test_projected_lstm.py::test_jit_compiled_train_step_equals_plain_train_step": "two fits, one XLA-compiled (2.5 s)",
    "test_projected_lstm.py::test_every_variant_matches_float64_reference[while_xla-holes_backwards_state]": (
        "an XLA compile on the CPU (2 s); [custom_xla-holes_backwards_state] stays fast"
    ),
    "test_cudnn_op_wrapper.py::test_shared_steps_trace_once_and_pass_the_algorithm_at_run_time": (
        "traces and runs the tuner's shared steps (2.6 s); the threads test runs plans at run time too"
    ),
    "test_equivalence.py::test_graph_mode_mask_switch_is_exact[lstm]": "traces both branches (2.3 s); [gru] stays fast",
    # The full grid runs in the slow set; one case per cell kind and merge stays fast.
    **{
        f"test_bidirectional_and_cells.py::test_sum_and_ave_below_the_top_fuse_into_one_call[{case}]": (
            "1-1.5 s each, 16 cases; unmasked-sum-lstm, right_padded-ave-gru, "
            "right_padded-sum-rnn_tanh and unmasked-ave-rnn_relu stay fast"
        )
        for case in (
            "right_padded-ave-lstm", "right_padded-sum-lstm", "unmasked-ave-lstm",
            "right_padded-sum-gru", "unmasked-ave-gru", "unmasked-sum-gru",
            "right_padded-ave-rnn_tanh", "unmasked-ave-rnn_tanh", "unmasked-sum-rnn_tanh",
            "right_padded-ave-rnn_relu", "right_padded-sum-rnn_relu", "unmasked-sum-rnn_relu",
        )
    },
    **{
        f"test_bidirectional_and_cells.py::test_pieces_split_between_a_summing_level_and_the_next[{case}]": (
            "1.5 s each; [pieces0] stays fast"
        )
        for case in ("pieces1", "pieces2", "pieces3")
    },
    # -- JAX: XLA compiles on the CPU ------------------------------------------
    # The cuDNN core's emulation: each case compiles a gradient. The fast loop
    # keeps the RNNs unidirectional, two gradient cases and the tuner's
    # algorithm test; bidirectional stacks and the rest run with the slow set.
    **{
        f"jax_backend/test_jax_core.py::test_every_kind_is_one_core_call_matching_keras[True-{kind}]": (
            "a bidirectional stack compiled forward and backward (19-29 s); [False-*] stay fast"
        )
        for kind in ("lstm", "gru", "rnn_tanh", "rnn_relu")
    },
    **{
        f"jax_backend/test_jax_core.py::test_every_kind_is_one_core_call_matching_keras[False-{kind}]": (
            f"a {kind.upper()} stack compiled forward and backward (15-30 s); the RNNs stay fast"
        )
        for kind in ("lstm", "gru")
    },
    **{
        f"jax_backend/test_jax_core.py::test_the_custom_vjp_is_cudnns_gradient[{case}]": (
            "jax.grad of the emulated core against JAX's own, compiled (18-33 s)"
        )
        for case in ("False-lstm-2-3", "True-lstm-2-3", "False-gru-2-0", "True-gru-2-0",
                     "False-rnn_relu-1-0", "True-lstm-1-0", "False-lstm-1-0")
    },
    "jax_backend/test_jax_fused.py::test_masked_calls_run_the_core_with_lengths": (
        "masked stacks compiled through Keras (10-19 s); the core's ragged gradient case stays fast"
    ),
    "jax_backend/test_jax_core.py::test_data_parallel_over_two_devices_runs_the_core": (
        "a subprocess with two forced host devices (18 s)"
    ),
    "jax_backend/test_jax_ffi_build.py::test_the_cudnn_handlers_build_link_the_core_and_register": (
        "g++ builds the core and its FFI library (19 s)"
    ),
    "jax_backend/test_jax_fused.py::test_tuner_times_per_layer_and_fused_under_jax": (
        "times every candidate, compiled (38 s); test_jax_tuning's algorithm test stays fast"
    ),
    "jax_backend/test_jax_activity_regularizers.py::test_activity_losses_and_training_match_the_original": (
        "evaluate and a fit epoch, compiled (23 s for four cases); the TF and torch cases stay fast"
    ),
    # The fast loop keeps one stack matched against Keras ([3]), one state
    # case, masks, dropout, jit fit and the tuner under JAX; bidirectional
    # stacks and the CLI under JAX run with the slow set.
    "jax_backend/test_jax_fused.py::test_bidirectional_sum_and_ave_below_the_top": "compiles, 6-15 s a case",
    "jax_backend/test_jax_fused.py::test_bidirectional_stack": "compiles (9 s)",
    "jax_backend/test_jax_wavefront_bidirectional.py::test_tune_times_the_plan_with_the_switch_on": (
        "jitted training steps per candidate (17 s); test_the_tuner_is_offered_the_plan_only_with_the_switch_on stays fast"
    ),
    **{f"jax_backend/test_jax_wavefront_bidirectional.py::{name}": (
        "jitted gradients, 5-15 s a case; the 1-layer ragged GRU case and one Keras case stay fast")
       for name in ("test_the_composition_is_cudnns_bidirectional_stack[1-True-lstm]",
                    "test_the_composition_is_cudnns_bidirectional_stack[3-True-lstm]",
                    "test_the_composition_is_cudnns_bidirectional_stack[3-True-gru]",
                    "test_the_composition_is_cudnns_bidirectional_stack[1-False-lstm]",
                    "test_the_composition_is_cudnns_bidirectional_stack[1-False-gru]",
                    "test_a_layer_on_the_plan_matches_keras_bidirectional_layers[gru-sum-1-True-True]",
                    "test_a_layer_on_the_plan_matches_keras_bidirectional_layers[gru-ave-2-False-True]",
                    "test_a_layer_on_the_plan_matches_keras_bidirectional_layers[lstm-ave-2-True-False]",
                    "test_a_layer_on_the_plan_matches_keras_bidirectional_layers[gru-concat-3-True-False]",
                    "test_a_layer_on_the_plan_matches_keras_bidirectional_layers[lstm-sum-3-True-True]")},
    # The TensorFlow twin: one ragged GRU case of the equations, one inference
    # case, one Keras training case, the switch and the tuner stay fast.
    **{f"test_wavefront_bidirectional_tf.py::{name}": (
        "eager step-by-step references a direction, 0.3-0.7 s a case")
       for name in ("test_the_composition_is_cudnns_bidirectional_stack[1-True-lstm]",
                    "test_the_composition_is_cudnns_bidirectional_stack[3-True-lstm]",
                    "test_the_composition_is_cudnns_bidirectional_stack[3-True-gru]",
                    "test_the_composition_is_cudnns_bidirectional_stack[1-False-lstm]",
                    "test_the_composition_is_cudnns_bidirectional_stack[1-False-gru]",
                    "test_inference_runs_the_inference_op_a_direction[lstm]",
                    "test_a_training_call_on_the_plan_matches_keras_bidirectional_layers[gru-concat-3-True-False]",
                    "test_a_training_call_on_the_plan_matches_keras_bidirectional_layers[lstm-sum-3-True-True]",
                    "test_a_training_call_on_the_plan_matches_keras_bidirectional_layers[gru-ave-2-False-True]",
                    "test_a_training_call_on_the_plan_matches_keras_bidirectional_layers[lstm-ave-2-True-False]",
                    "test_a_training_call_on_the_plan_matches_keras_bidirectional_layers[gru-sum-1-True-True]",
                    "test_a_layer_the_kernel_refuses_runs_cudnn_with_the_reason")},
    "test_wavefront_bidirectional_tf.py::test_tune_times_the_plan_with_the_switch_on": (
        "traced training steps per candidate (23 s); test_the_tuner_times_the_plan_with_the_switch_on stays fast"
    ),
    "jax_backend/test_jax_fused.py::test_lstm_stack_is_one_call_and_matches_keras[2]": "compiles (9 s); [3] stays fast",
    "jax_backend/test_jax_fused.py::test_returned_states_with_initial_states[False]": "compiles (6 s); [True] stays fast",
    "jax_backend/test_jax_cli.py::test_check_runs_under_jax": "gradients of two compiled models (8 s)",
    "jax_backend/test_jax_tuner_programs.py::test_the_gradient_check_is_one_compiled_program": (
        "compiles the emulated core's reference, plan and twin gradients (6 s); "
        "test_gradients_of_all_calls_is_one_compiled_program stays fast"),
    "jax_backend/test_jax_tuner_programs.py::test_the_jitted_gradients_are_those_of_jax_grad_alone": (
        "the emulated core's gradients op by op and compiled (9 s a case)"),
    **{f"jax_backend/test_jax_tuner_programs.py::test_the_fused_float64_reference_is_the_copies_own_float64[{k}]": (
        "compiles the emulated core's float64 call and the copies' (4 s); [lstm] stays fast")
       for k in ("gru", "rnn_tanh")},
    "jax_backend/test_jax_tuner_programs.py::test_the_gradient_checks_reference_runs_float64_copies_of_the_layers[bi_gru-mixed_float16]": (
        "float64 copies of a bidirectional GRU, compiled (5 s); [lstm-float32] stays fast"),
    "jax_backend/test_jax_tuner_programs.py::test_a_step_traced_and_compiled_ahead_runs_what_jit_runs": (
        "compiles an emulated training step twice (5 s); timed_step's doctest and "
        "test_tuning_stages.py's compile tests stay fast"),
    "jax_backend/test_jax_tuning.py::test_a_custom_jitted_loop_runs_its_modes_decision_not_the_last_one_set": (
        "a timed predict and fit, then a jitted custom step (15-57 s); the first-fit tuning test stays fast"
    ),
    "jax_backend/test_jax_half_precision.py::test_a_fit_too_short_to_time_runs_fused_and_trains": (
        "a compiled mixed_float16 fit a case (7-15 s); the first-batch fit test of that file and "
        "table.fused_where_keras_fails' doctest stay fast"
    ),
    "jax_backend/test_jax_cli.py::test_bench_runs_under_jax": "two compiled models timed (5 s)",
    # The emulated kernel's gradients compile unrolled loops: one case per
    # backward ([True-lstm-stack]) and the Keras-level LSTM stay fast.
    **{
        f"jax_backend/test_jax_wavefront.py::test_outputs_and_gradients_are_cudnns_equations[{case}]": (
            "compiles the emulation's and the reference's gradients (10-15 s)"
        )
        for case in ("False-lstm-stack", "False-lstm-layer", "True-lstm-layer", "False-gru-layer",
                     "True-gru-layer")
    },
    "jax_backend/test_jax_wavefront.py::test_the_gradient_is_not_the_reference_with_a_wrong_gemm": (
        "three gradients of the emulation (12 s)"
    ),
    "jax_backend/test_jax_wavefront.py::test_a_layer_on_the_wavefront_plan_matches_the_original_layers[gru]": (
        "compiles both models' gradients (15-20 s); [lstm] stays fast"
    ),
    "jax_backend/test_jax_wavefront.py::test_first_batch_tuning_under_jax_times_the_kernel": (
        "optimize's first-batch tuning inside fit: compiled candidates (60 s)"
    ),
    "jax_backend/test_jax_wavefront.py::test_tune_times_the_kernels_jitted_step": (
        "times three compiled training candidates on the emulated kernel (45 s)"
    ),
    "jax_backend/test_jax_ffi_build.py::test_the_handlers_compile_and_register_with_jax": (
        "g++ builds the XLA FFI library (10-30 s)"
    ),
    "jax_backend/test_jax_ffi_build.py::test_the_library_workspace_sizes_are_the_bindings": (
        "the same build (shared with the test above)"
    ),
    # -- keeping the fast loop under its 6 minutes on a 2-core machine ---------
    "jax_backend/test_jax_core.py::test_an_algorithm_cudnn_refuses_runs_as_standard_with_the_reason": (
        "two compiled fits on the emulation (9.5 s)"
    ),
    "jax_backend/test_jax_half_precision.py::test_first_batch_fit_survives_an_original_candidate_that_fails": (
        "first-batch tuning in a fit with a failing candidate (8 s)"
    ),
    "jax_backend/test_jax_core.py::test_backward_weights_must_read_backward_datas_reserve": (
        "compiles the emulated backward twice (6 s)"
    ),
    "test_wavefront_lamport.py::test_a_stored_value_never_reads_as_unwritten_and_keeps_its_meaning[float16]": (
        "every float16 bit pattern (9 s); [bfloat16] stays fast"
    ),
    "test_properties.py::test_optimized_models_keep_every_property": (
        "hypothesis over optimized models, each built and called (14 s)"
    ),
}


def slow_reason(nodeid: str) -> str | None:
    """Why the test `nodeid` (relative to tests/) is slow, or None."""
    if nodeid in SLOW:
        return SLOW[nodeid]
    return SLOW.get(nodeid.split("[", 1)[0])

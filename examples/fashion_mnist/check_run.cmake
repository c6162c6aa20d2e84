# Runs kfac_fashion_mnist (or, with LAUNCH, a data-parallel run of kfac_fashion_mnist_mpi) and
# checks what it printed and wrote (cmake -P; used by CTest):
#   -DPROGRAM=path -DOUT=prefix -DARGS="--model cnn ..." -DOPTIMIZERS="sgd kfac" -DEPOCHS=N
#   [-DLAUNCH="mpiexec -n 2"] [-DREFERENCE=path/to/kfac_fashion_mnist -DTOLERANCE=0.0200]
#   [-DREFERENCE_OUTPUT=file] [-DSAVE_OUTPUT=file] [-DRESUME=1] [-DEXPECT_LR="0.1 0.1 0.3"]
# * every optimizer prints one well-formed summary line and has one CSV row per epoch 0..N;
# * EXPECT_LR: every optimizer's CSV gives these learning rates (as printed, %.6g) at epochs
#   0..N (the rate of each epoch's first step);
# * SAVE_OUTPUT: what the run printed is written to that file (for REFERENCE_OUTPUT);
# * REFERENCE: the single-process program is run with the same arguments and every
#   optimizer's final accuracy must be within TOLERANCE (4 decimals) of its single-process one;
#   with REFERENCE_OUTPUT, the single-process run is not repeated: its summary lines are read
#   from that file, which a run of REFERENCE with the same arguments saved (a CTest fixture).
# * RESUME: the run is repeated in two halves (--checkpoint with --stop-after, then --resume)
#   and must end with exactly the same test accuracies.
# The program exits 77 when the data set is missing: the test is then skipped.
foreach(var PROGRAM OUT ARGS OPTIMIZERS EPOCHS)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "check_run.cmake: -D${var}=... is required")
  endif()
endforeach()

separate_arguments(ARGS UNIX_COMMAND "${ARGS}")
separate_arguments(OPTIMIZERS UNIX_COMMAND "${OPTIMIZERS}")
if(DEFINED LAUNCH)
  separate_arguments(LAUNCH UNIX_COMMAND "${LAUNCH}")
endif()
# With REFERENCE, ARGS minus --strategy S is what the single-process program takes.
set(REFERENCE_ARGS ${ARGS})
list(FIND REFERENCE_ARGS --strategy at)
if(NOT at EQUAL -1)
  math(EXPR value_at "${at} + 1")
  list(REMOVE_AT REFERENCE_ARGS ${at} ${value_at})
endif()

# "0.8765" -> 8765 (units of 1e-4; cmake's math has integers only).
function(to_units out text)
  if(NOT text MATCHES "^([01])\\.([0-9][0-9][0-9][0-9])$")
    message(FATAL_ERROR "'${text}' is not a number with 4 decimals in [0, 1]")
  endif()
  set(whole ${CMAKE_MATCH_1})
  # Leading zeros stripped in one match: CMake's REGEX REPLACE re-applies a "^" pattern to what
  # is left, so "^0+([0-9])" made 0200 into 20, and a 2-point tolerance into 0.2 points.
  string(REGEX REPLACE "^0+" "" fraction "${CMAKE_MATCH_2}")
  if(fraction STREQUAL "")
    set(fraction 0)
  endif()
  math(EXPR value "${whole} * 10000 + ${fraction}")
  set(${out} ${value} PARENT_SCOPE)
endfunction()

# Sets <var>_<optimizer> to each optimizer's final accuracy in `text`, what `source` printed;
# fails unless every optimizer has one well-formed summary line for EPOCHS epochs.
function(read_summaries var text source)
  foreach(optimizer IN LISTS OPTIMIZERS)
    if(NOT text MATCHES "summary optimizer=${optimizer} model=[a-z]+ epochs=${EPOCHS} test_accuracy=([01]\\.[0-9]+) seconds=[0-9]+\\.[0-9]")
      message(FATAL_ERROR "${source}: no well-formed summary line for ${optimizer} after ${EPOCHS} epochs")
    endif()
    set(${var}_${optimizer} ${CMAKE_MATCH_1} PARENT_SCOPE)
  endforeach()
endfunction()

# Runs a command (the CSV path and --no-plot appended). Sets <var> to what it printed and,
# unless PARTIAL, <var>_<optimizer> to each optimizer's final accuracy; <var>_skipped when the
# data set is missing.
function(run_program var partial csv)
  file(REMOVE ${csv})  # a stale file must not pass
  execute_process(COMMAND ${ARGN} --csv ${csv} --no-plot RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("+ ${ARGN}\n${out}${err}")
  if(rc EQUAL 77)
    message("SKIPPED: Fashion-MNIST not found (apt install dataset-fashion-mnist)")
    set(${var}_skipped TRUE PARENT_SCOPE)
    return()
  endif()
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "exit status ${rc}")
  endif()
  set(${var} "${out}" PARENT_SCOPE)
  if(partial)
    return()
  endif()
  read_summaries(${var} "${out}" "the program's output")
  foreach(optimizer IN LISTS OPTIMIZERS)
    set(${var}_${optimizer} ${${var}_${optimizer}} PARENT_SCOPE)
  endforeach()
endfunction()

run_program(run FALSE ${OUT}.csv ${LAUNCH} ${PROGRAM} ${ARGS} --epochs ${EPOCHS})
if(run_skipped)
  return()
endif()
if(DEFINED SAVE_OUTPUT)
  file(WRITE ${SAVE_OUTPUT} "${run}")
endif()
file(STRINGS ${OUT}.csv lines)
list(POP_FRONT lines header)
if(NOT header STREQUAL "optimizer,model,seed,epoch,lr,train_loss,test_loss,test_accuracy,seconds")
  message(FATAL_ERROR "${OUT}.csv: unexpected header '${header}'")
endif()
foreach(optimizer IN LISTS OPTIMIZERS)
  foreach(epoch RANGE 0 ${EPOCHS})
    if(NOT lines MATCHES "(^|;)${optimizer},[a-z]+,[0-9]+,${epoch},[-+.e0-9]+,[-+.e0-9na]+,[.0-9]+,[.0-9]+,[.0-9]+(;|$)")
      message(FATAL_ERROR "${OUT}.csv: no well-formed row for ${optimizer} at epoch ${epoch}")
    endif()
  endforeach()
endforeach()

if(DEFINED EXPECT_LR)
  separate_arguments(EXPECT_LR UNIX_COMMAND "${EXPECT_LR}")
  foreach(optimizer IN LISTS OPTIMIZERS)
    set(epoch 0)
    foreach(lr IN LISTS EXPECT_LR)
      string(REPLACE "." "\\." lr_pattern "${lr}")
      if(NOT lines MATCHES "(^|;)${optimizer},[a-z]+,[0-9]+,${epoch},${lr_pattern},")
        message(FATAL_ERROR "${OUT}.csv: ${optimizer}'s learning rate at epoch ${epoch} is not ${lr}")
      endif()
      math(EXPR epoch "${epoch} + 1")
    endforeach()
  endforeach()
  message("learning rates at epochs 0..${EPOCHS}: ${EXPECT_LR}, as expected")
endif()

if(DEFINED REFERENCE)
  if(DEFINED REFERENCE_OUTPUT)
    if(NOT EXISTS ${REFERENCE_OUTPUT})
      message(FATAL_ERROR "${REFERENCE_OUTPUT}, the single-process run's output, is missing")
    endif()
    file(READ ${REFERENCE_OUTPUT} saved)
    read_summaries(single "${saved}" ${REFERENCE_OUTPUT})
  else()
    run_program(single FALSE ${OUT}_single.csv ${REFERENCE} ${REFERENCE_ARGS} --epochs ${EPOCHS})
  endif()
  to_units(tolerance ${TOLERANCE})
  foreach(optimizer IN LISTS OPTIMIZERS)
    to_units(a ${run_${optimizer}})
    to_units(b ${single_${optimizer}})
    math(EXPR diff "${a} - ${b}")
    if(diff LESS 0)
      math(EXPR diff "-${diff}")
    endif()
    message("${optimizer}: data-parallel ${run_${optimizer}}, one process ${single_${optimizer}}")
    if(diff GREATER tolerance)
      message(FATAL_ERROR "${optimizer}: the data-parallel accuracy differs from the single-process one by more than ${TOLERANCE}")
    endif()
  endforeach()
endif()

if(RESUME)
  file(REMOVE_RECURSE ${OUT}_checkpoint)
  math(EXPR half "${EPOCHS} / 2")
  run_program(first TRUE ${OUT}_first.csv ${LAUNCH} ${PROGRAM} ${ARGS} --epochs ${EPOCHS}
              --checkpoint ${OUT}_checkpoint --stop-after ${half})
  if(NOT first MATCHES "stopped after epoch ${half}")
    message(FATAL_ERROR "the first half did not stop after epoch ${half}")
  endif()
  run_program(resumed FALSE ${OUT}_resumed.csv ${LAUNCH} ${PROGRAM} ${ARGS} --epochs ${EPOCHS}
              --resume ${OUT}_checkpoint)
  foreach(optimizer IN LISTS OPTIMIZERS)
    if(NOT resumed MATCHES "${optimizer}: resumed from [^\n]* after epoch ${half}")
      message(FATAL_ERROR "${optimizer} did not resume after epoch ${half}")
    endif()
    if(NOT resumed_${optimizer} STREQUAL run_${optimizer})
      message(FATAL_ERROR "${optimizer}: the resumed run ends at ${resumed_${optimizer}}, the straight run at ${run_${optimizer}}")
    endif()
    message("${optimizer}: the resumed run ends at ${resumed_${optimizer}}, as the straight run")
  endforeach()
endif()

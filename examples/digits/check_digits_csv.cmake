# Runs kfac_digits for a few epochs and checks what it wrote (cmake -P; used by CTest).
#   -DPROGRAM=path/to/kfac_digits -DCSV=out.csv -DEPOCHS=3 -DEXPECT_ACCURACY=0.93
# Fails when the program fails (including K-FAC's final test accuracy below EXPECT_ACCURACY)
# or when the CSV does not hold the header and, per optimizer, one row for epochs 0..EPOCHS.
# When the data set is missing the program exits 77 and says "digits data set not found",
# which the test's SKIP_REGULAR_EXPRESSION turns into a skip.
foreach(var PROGRAM CSV EPOCHS EXPECT_ACCURACY)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "check_digits_csv.cmake: -D${var}=... is required")
  endif()
endforeach()

file(REMOVE ${CSV})  # a stale file must not pass
execute_process(COMMAND ${PROGRAM} --epochs ${EPOCHS} --csv ${CSV} --no-plot
                        --expect-accuracy ${EXPECT_ACCURACY}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(rc EQUAL 77)
  message("SKIPPED: digits data set not found (apt install python3-sklearn)")
  return()
endif()
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "kfac_digits exited with ${rc}")
endif()

file(STRINGS ${CSV} lines)
list(LENGTH lines count)
math(EXPR expected "1 + 2 * (${EPOCHS} + 1)")
if(NOT count EQUAL expected)
  message(FATAL_ERROR "${CSV}: ${count} lines, expected ${expected} (header + 2 optimizers x ${EPOCHS}+1 epochs)")
endif()
list(POP_FRONT lines header)
if(NOT header STREQUAL "optimizer,epoch,train_loss,test_accuracy,wall_seconds")
  message(FATAL_ERROR "${CSV}: unexpected header '${header}'")
endif()
set(number "[0-9]+\\.[0-9]+")
foreach(optimizer SGD SGD+K-FAC)
  string(REPLACE "+" "\\+" escaped ${optimizer})
  foreach(epoch RANGE 0 ${EPOCHS})
    set(found FALSE)
    foreach(line IN LISTS lines)
      if(line MATCHES "^${escaped},${epoch},${number},(${number}),${number}$")
        set(found TRUE)
        if(CMAKE_MATCH_1 GREATER 1)
          message(FATAL_ERROR "${CSV}: accuracy above 1 in '${line}'")
        endif()
      endif()
    endforeach()
    if(NOT found)
      message(FATAL_ERROR "${CSV}: no well-formed row for ${optimizer} at epoch ${epoch}")
    endif()
  endforeach()
endforeach()
message("check_digits_csv: ${CSV} has the expected ${count} lines")
